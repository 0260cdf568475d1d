"""`--mode=sample --chat=JSON` (or `--chat_file`): conversations rendered with the run's chat template.

The template is the one the model was fine-tuned with: a Hugging Face directory's
tokenizer_config.json (the source is the directory, or an export of ours, which writes the
template there), else the `sft.chat_template` that `prepare --sft` recorded in the header of the
run's token file. The conversation is rendered as transformers does for `generate`
(`add_generation_prompt=True`), so the model continues with the assistant's turn, and a row ends
at the template's end-of-turn token: found by rendering a one-word assistant turn and taking the
first special token after its content (ChatML's <|im_end|>, Llama 3's <|eot_id|>), besides the
tokenizer's end-of-text. `transformers` is imported only here, in this mode.
"""

from __future__ import annotations

import json
from typing import Any

from jaxfrontier.data import chat as chat_lib
from jaxfrontier.data import token_files
from jaxfrontier.errors import UserError

_FORMAT = '[{"role": "user", "content": "..."}]'


def read_chats(chat: list[str], chat_file: str) -> list[list[dict[str, Any]]]:
    """The conversations of every --chat (a JSON list of messages each) or of --chat_file's lines."""
    if chat and chat_file:
        raise UserError(f'both --chat and --chat_file={chat_file} given. Fix: pass the conversations one way.')
    sources = [(f'--chat={text}', text) for text in chat]
    if chat_file:
        try:
            with open(chat_file, encoding='utf-8') as f:
                sources = [(f'--chat_file={chat_file} line {n}', line) for n, line in enumerate(f, 1) if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f'cannot read --chat_file={chat_file} ({getattr(e, "strerror", None) or e}). Fix: name '
                            f'a UTF-8 file with one conversation per line, e.g. {_FORMAT}.') from None
    conversations = []
    for where, text in sources:
        try:
            messages = json.loads(text)
        except ValueError as e:
            raise UserError(f'{where[:120]} is not JSON ({e.msg}). Fix: write the conversation as {_FORMAT}.') from None
        if isinstance(messages, dict) and 'messages' in messages:
            messages = messages['messages']
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and m.get('role') in chat_lib.ROLES and isinstance(m.get('content'), str)
                for m in messages)):
            raise UserError(f'{where[:120]} is not a list of messages with a role ({", ".join(chat_lib.ROLES)}) and '
                            f'a string content. Fix: write the conversation as {_FORMAT}.')
        conversations.append(messages)
    if not conversations:
        raise UserError(f'--chat_file={chat_file} holds no conversation. Fix: one conversation per line, {_FORMAT}.')
    return conversations


def chat_tokenizer(hf_dir: str | None, run_data: dict[str, Any], vocab_size: int) -> Any:
    """A transformers tokenizer with the run's chat template (module docstring); one line without one."""
    if hf_dir:
        tokenizer, where = chat_lib.load_tokenizer(hf_dir), hf_dir
    else:
        path = token_files.run_token_path(run_data) if run_data.get('kind') == 'tokens' else ''
        if not path:
            raise UserError('--chat needs a chat template, but the run trained on no token file of prepare --sft. '
                            'Fix: sample from a Hugging Face directory with one (checkpoint.init_params_from=DIR), '
                            'or fine-tune on conversations prepared with prepare --sft --tokenizer=DIR.')
        token_file = token_files.open_token_file(path, vocab_size)
        tokenizer_file, where = token_files.tokenizer_path(token_file), path
        if tokenizer_file is None:
            raise UserError(f'the token file {path} records no tokenizer, so --chat cannot be rendered. Fix: '
                            'prepare the data with python -m jaxfrontier.prepare --sft --tokenizer=DIR.')
        tokenizer = chat_lib.load_tokenizer(tokenizer_file)  # a tokenizer.json: no template of its own
        tokenizer.chat_template = (token_file.header.get('sft') or {}).get('chat_template')
    if not getattr(tokenizer, 'chat_template', None):
        raise UserError(f'the tokenizer of {where} has no chat template (tokenizer_config.json "chat_template"), so '
                        '--chat cannot be rendered. Fix: use --prompt with the text itself, or a chat model\'s '
                        'tokenizer directory.')
    return tokenizer


def render(tokenizer: Any, conversations: list[list[dict[str, Any]]]) -> tuple[list[str], list[list[int]]]:
    """(text, token ids) of each conversation with the generation prompt; one line if the template refuses it."""
    texts, ids = [], []
    for n, messages in enumerate(conversations, 1):
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # pylint: disable=broad-except  (the template is the user's code)
            raise UserError(f'the chat template fails on conversation {n} ({type(e).__name__}: '
                            f'{" ".join(str(e).split())[:200]}). Fix: e.g. alternate user and assistant turns as '
                            'the template demands.') from None
        texts.append(text)
        ids.append(list(tokenizer(text, add_special_tokens=False)['input_ids']))
    return texts, ids


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The template's end-of-turn token (module docstring) and the tokenizer's eos token, where they exist."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - {tokenizer.unk_token_id}
    prompt = [{'role': 'user', 'content': 'a'}]
    try:
        start = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(prompt + [{'role': 'assistant', 'content': 'a'}], tokenize=False)
    except Exception:  # pylint: disable=broad-except  (a template that needs more: eos only)
        start, whole = '', ''
    ids = []
    if whole.startswith(start):
        after = tokenizer(whole[len(start):], add_special_tokens=False)['input_ids']
        content = tokenizer('a', add_special_tokens=False)['input_ids']
        after = after[len(content):] if after[:len(content)] == content else after  # 'a' may be <unk>, special
        ids = [i for i in after if i in special][:1]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
