"""Entry point: tokenise a text corpus into a token file that `data.kind='tokens'` trains on.

  python -m jaxfrontier.prepare --input="corpus/*.jsonl" --output=data/mycorpus --train_tokenizer=8192
  python -m jaxfrontier.main --config=configs/tiny.py --config.data.kind=tokens \\
      --config.data.path=data/mycorpus.bin --config.model.vocab_size=8192

Inputs are .txt (one document per file), .jsonl (--text_field) or .parquet (--text_field);
the tokenizer is a Hugging Face tokenizer.json (--tokenizer) or a byte-level BPE trained on
the inputs (--train_tokenizer). Writes DIR/NAME.bin, NAME.json and NAME.tokenizer.json
atomically (docs/data.md); with --val_fraction or --val_documents, NAME_train.bin / .json and
NAME_val.bin / .json, validation documents drawn at random (--seed); --shuffle reorders documents. Bad input is one line on stderr and exit code 2. No JAX import.

Supervised fine-tuning data: --sft reads conversation JSONL (`messages`, or `prompt` / `completion`),
renders it with the chat template of a Hugging Face tokenizer directory (pip install 'jaxfrontier[sft]')
and writes NAME.mask.bin beside each .bin, 1 where the prediction of a token counts (--loss_on):

  python -m jaxfrontier.prepare --sft --input=chats.jsonl --tokenizer=/models/qwen --output=data/chats \\
      --val_fraction=0.01 --max_tokens=2049
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from absl import app, flags

from jaxfrontier import cli, errors
from jaxfrontier.data import documents
from jaxfrontier.data import encode as tokenize_lib
from jaxfrontier.data import dpo as dpo_lib
from jaxfrontier.data import sft as sft_lib
from jaxfrontier.errors import DiskFullError, FlagError, UserError

_INPUT = flags.DEFINE_multi_string('input', [], 'Input files or globs, comma-separated or repeated: *.txt '
                                   '(one document per file), *.jsonl, *.parquet.')
_OUTPUT = flags.DEFINE_string('output', '', 'DIR/NAME: writes NAME.bin, NAME.json and NAME.tokenizer.json in DIR.')
_TOKENIZER = flags.DEFINE_string('tokenizer', '', 'A Hugging Face tokenizer.json, or a directory holding one.')
_TRAIN_TOKENIZER = flags.DEFINE_integer('train_tokenizer', 0, 'Train a byte-level BPE (as GPT-2) of at most '
                                        'this vocabulary on the inputs, instead of --tokenizer.')
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'The JSONL field / Parquet column holding the text.')
_EOT_TOKEN = flags.DEFINE_string('eot_token', '', 'The token put after every document; default the first of '
                                 f'{list(tokenize_lib.EOT_CANDIDATES)} the tokenizer has.')
_WORKERS = flags.DEFINE_integer('workers', 1, 'Encoding processes; 1 encodes in this process with the '
                                'tokenizers library\'s own threads.')
_BATCH_MB = flags.DEFINE_float('batch_mb', 1.0, 'Megabytes of input per encoded batch.')
_VAL_FRACTION = flags.DEFINE_float('val_fraction', 0.0, 'Share of documents, drawn at random (--seed), written to '
                                   'NAME_val.bin instead of NAME_train.bin; 0: no split, one NAME.bin.')
_VAL_DOCUMENTS = flags.DEFINE_integer('val_documents', 0, 'As --val_fraction, a number of documents instead.')
_SHUFFLE = flags.DEFINE_bool('shuffle', False, 'Write the documents in a random order (--seed) instead of the '
                             "corpus's.")
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the validation documents and of --shuffle.')
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar (MB/s, tokens/s) on a terminal.')
_SFT = flags.DEFINE_bool('sft', False, 'Supervised fine-tuning data: --input is conversation JSONL, rendered with '
                         "the chat template of --tokenizer=DIR; writes NAME.mask.bin (the loss mask) beside NAME.bin.")
_LOSS_ON = flags.DEFINE_string('loss_on', 'assistant', '--sft: the tokens whose prediction counts: assistant (every '
                               'assistant turn with its end-of-turn token), last_assistant, or all.')
_MAX_TOKENS = flags.DEFINE_integer('max_tokens', 0, '--sft: at most this many tokens per conversation, end-of-text '
                                   'included (e.g. model.seq_len + 1); 0: no bound. Longer ones: --overlong.')
_OVERLONG = flags.DEFINE_string('overlong', 'truncate', '--sft: a conversation over --max_tokens is cut to it '
                                '(truncate) or left out (drop); either is counted and reported.')
_DPO = flags.DEFINE_bool('dpo', False, 'Preference pairs for DPO: --input is JSONL of {"prompt", "chosen", '
                          '"rejected"}, each side rendered with --tokenizer\'s chat template into a row of --seq_len + 1 '
                          'tokens (row 2i chosen, 2i + 1 rejected; data/dpo.py).')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 2048, '--dpo: the model\'s seq_len; each row holds seq_len + 1 tokens.')
_MESSAGES_FIELD = flags.DEFINE_string('messages_field', 'messages', '--sft: the JSONL field holding the list of '
                                      'messages (records with "prompt" and "completion" are read too).')
_SFT_ONLY = ('loss_on', 'max_tokens', 'overlong', 'messages_field')


class _Progress:
    """A tqdm bar over input bytes (MB/s) with tokens/s beside it; silent when not on a terminal."""

    def __init__(self, total_bytes: int, enabled: bool):
        from tqdm import tqdm  # pylint: disable=g-import-not-at-top
        self.bar = tqdm(total=total_bytes, unit='B', unit_scale=True, desc='prepare',
                        disable=None if enabled else True, file=sys.stderr)
        self.start = time.perf_counter()

    def __call__(self, num_bytes: int, num_tokens: int) -> None:
        self.bar.update(num_bytes)
        rate = num_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f'{num_tokens:,} tokens, {rate / 1e6:.2f} M tokens/s', refresh=False)

    def note(self, line: str) -> None:
        """A line on stderr, above the bar when there is one."""
        self.bar.write(line, file=sys.stderr)
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    try:
        if _SFT.value and _DPO.value:
            raise FlagError('dpo', True, '--sft (conversations with a loss mask) and --dpo (preference pairs) write '
                            'different kinds of data', 'pass one of them')
        if not _OUTPUT.value:
            raise FlagError('output', '', 'no output named', 'pass --output=DIR/NAME')
        if not _INPUT.value:
            raise FlagError('input', '', 'no input named', 'pass --input=FILE_OR_GLOB[,...]')
        files = tokenize_lib.corpus.expand_inputs(_INPUT.value)
        progress = _Progress(sum(map(os.path.getsize, files)), _PROGRESS.value)
        split = documents.Split(_VAL_FRACTION.value, _VAL_DOCUMENTS.value, _SEED.value, _SHUFFLE.value)
        common = dict(eot_token=_EOT_TOKEN.value, workers=_WORKERS.value, progress=progress, split=split,
                      batch_bytes=max(1, int(_BATCH_MB.value * 1e6)))
        if _DPO.value:
            return _prepare_dpo(files)
        if _SFT.value:
            result = sft_lib.prepare(files, _OUTPUT.value, tokenizer_path=_sft_tokenizer(), options=sft_lib.Options(
                _LOSS_ON.value, _MAX_TOKENS.value, _OVERLONG.value, _MESSAGES_FIELD.value), notify=progress.note,
                **common)
        else:
            for name in _SFT_ONLY:
                if flags.FLAGS[name].present:
                    raise FlagError(name, flags.FLAGS[name].value, 'applies to conversations only', 'add --sft')
            result = tokenize_lib.prepare(files, _OUTPUT.value, tokenizer_path=_TOKENIZER.value,
                                          train_vocab=_TRAIN_TOKENIZER.value, text_field=_TEXT_FIELD.value, **common)
        progress.bar.close()
    except OSError as e:
        full = errors.disk_full(e)
        if full is None:
            raise
        print(f'error: {disk_full_error(full, _OUTPUT.value)}', file=sys.stderr)
        return 2
    except UserError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    num_tokens = sum(h['num_tokens'] for h in result.headers.values())
    for part, h in result.headers.items():
        order = 'shuffled' if h['documents_shuffled'] else 'in corpus order'
        what = f'{part} split by documents (seed {h["split"]["seed"]}), ' if part else ''
        print(f'wrote {result.bin_paths[part]}: {what}{h["num_tokens"]:,} {h["dtype"]} tokens of '
              f'{h["num_documents"]:,} documents {order}, vocabulary {h["vocab_size"]:,}, tokenizer {h["tokenizer"]}, '
              f'end-of-text {h["eot_token"]} = {h["eot_id"]}; {result.input_bytes / 1e6 / result.seconds:.2f} MB/s, '
              f'{num_tokens / result.seconds / 1e6:.2f} M tokens/s')
    if _SFT.value:
        header = next(iter(result.headers.values()))
        print(sft_line(header['sft'], num_tokens, sum(h['counted_tokens'] for h in result.headers.values()),
                       header['eot_token']))
    return 0


def disk_full_error(e: OSError, output: str) -> DiskFullError:
    """One line for a full disk or quota while prepare writes: the path, the free space there, what is left, the fix."""
    path = e.filename or output
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    try:
        free = f'{shutil.disk_usage(probe).free / 2**20:,.1f} MiB free'
    except OSError:
        free = 'free space unknown'
    return DiskFullError(f'no space left on the device holding {path} ({free}; {e.strerror or e}): nothing was '
                         'published, and no header describes a partial file (the temporaries are removed). Fix: free '
                         'space there, or pass an --output=DIR/NAME on a file system with room (a split or --shuffle '
                         'needs about twice the output while prepare runs)')


def _prepare_dpo(files: list[str]) -> int:
    """--dpo: preference pairs -> rows of seq_len + 1 (data/dpo.py); one line per file written."""
    headers = dpo_lib.prepare(files, _OUTPUT.value, tokenizer_path=_sft_tokenizer(), seq_len=_SEQ_LEN.value,
                              overlong=_OVERLONG.value, val_fraction=_VAL_FRACTION.value, seed=_SEED.value)
    for part, h in headers.items():
        n = h['dpo']['pairs']
        print(f'dpo: {h["dpo"]["pairs_in_file"]:,} pairs{" (" + part + ")" if part else ""} as rows of '
              f'{h["row_length"]} tokens ({h["dpo"]["rendering"]}); of all pairs {n["written"]:,} written, '
              f'{n["truncated"]:,} truncated, {n["dropped_overlong"]:,} dropped as over-long (--overlong='
              f'{h["dpo"]["overlong"]})')
    return 0


def _sft_tokenizer() -> str:
    """--tokenizer for --sft, after refusing the flags of text (a trained tokenizer has no chat template)."""
    if _TRAIN_TOKENIZER.value:
        raise FlagError('train_tokenizer', _TRAIN_TOKENIZER.value, '--sft renders conversations with the chat template '
                        'of an existing tokenizer', 'pass --tokenizer=DIR (a Hugging Face tokenizer directory) instead')
    if flags.FLAGS['text_field'].present:
        raise FlagError('text_field', _TEXT_FIELD.value, 'names the text of a document, but --sft reads conversations',
                        'pass --messages_field=<the field holding the messages> instead')
    if not _TOKENIZER.value:
        raise FlagError('tokenizer', '', '--sft renders conversations with the chat template of a tokenizer',
                        'pass --tokenizer=DIR (a Hugging Face tokenizer directory: tokenizer.json, '
                        'tokenizer_config.json)')
    return _TOKENIZER.value


def sft_line(sft: dict, num_tokens: int, counted: int, eot: str) -> str:
    """The log line of --sft: how conversations were rendered, what counts, what was cut or dropped."""
    n = sft['conversations']
    how = (f'rendered with the chat template of {sft["tokenizer_source"]}' if sft['rendering'] == 'chat_template' else
           f'prompt/completion pairs concatenated as plain text ({sft["tokenizer_source"]} has no chat template)')
    bound = (f'{n["truncated"]:,} truncated to --max_tokens={sft["max_tokens"]} ({n["cut_tokens"]:,} tokens cut), '
             f'{n["dropped_overlong"]:,} dropped as over-long, {n["dropped_empty"]:,} dropped with nothing left to '
             'learn after the cut' if sft['max_tokens'] else 'no --max_tokens: none truncated or dropped')
    inside = (f'; {n["eot_inside"]:,} conversations hold the end-of-text token {eot!r} inside (their template writes '
              'it), so data.pack_documents would cut them there: pass --eot_token=<a token conversations do not use> '
              'to pack them' if n['eot_inside'] else '')
    return (f'sft: {n["written"]:,} conversations {how}; loss on {sft["loss_on"]} tokens: {counted:,} of '
            f'{num_tokens:,} tokens count; {bound}{inside}')


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing; a malformed flag value is one line and exit 2, as every other bad input."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f'error: {" ".join(str(e).split())}. Fix: see python -m jaxfrontier.prepare --help', file=sys.stderr)
        sys.exit(2)
    except SystemExit as e:  # absl's --help prints the flags, then exits 1: asking for help is no failure
        sys.exit(0 if cli.wants_help(argv) and e.code == 1 else e.code)


def run() -> None:
    cli.run_app(main, flags_parser=parse_flags)


if __name__ == '__main__':
    run()
