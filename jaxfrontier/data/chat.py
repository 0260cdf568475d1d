"""Conversations for supervised fine-tuning: JSONL records -> tokens and the mask of those learned.

A record (one JSON line, corpus.read_records) is a conversation in one of the common formats:

- `{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}`
  (optionally `"tools": [...]`, passed to the template);
- `{"prompt": "...", "completion": "..."}`: the prompt is a user turn and the completion the
  assistant's; or both lists of messages (the conversational form), the completion's assistant
  turns being the ones learned.

`Renderer` renders it with the chat template of a Hugging Face tokenizer directory (its
`tokenizer_config.json`), through `transformers` -- the library that owns the template, so the
tokens are what the model will see at inference. Which tokens are learned is found for any
template: the conversation up to assistant turn j rendered with the generation prompt is a token
prefix of the rendering including turn j, and the tokens in between (the turn's content and the
end-of-turn token the model must learn to emit) are marked. Every such prefix must be a prefix
of the whole conversation's tokens; a template that breaks that (one that rewrites earlier
turns) is refused, naming the conversation. Without a template, prompt/completion pairs are
concatenated as plain text (prompt tokens, then completion tokens, the latter learned).

Every problem is a one-line FlagError naming the file and line. `transformers` and `jinja2` are
imported only here, in this mode (the `sft` extra).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Any

from jaxfrontier.data import corpus
from jaxfrontier.errors import FlagError

ROLES = ('system', 'user', 'assistant', 'tool')
LOSS_ON = ('assistant', 'all', 'last_assistant')  # --loss_on: which tokens count
_INSTALL = "pip install 'jaxfrontier[sft]' (transformers and jinja2 render chat templates)"


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A parsed record: its messages, the assistant turns learned, and the plain pair if it was one."""

    messages: list[dict[str, Any]]
    learned: tuple[int, ...]  # indices into messages of the assistant turns whose tokens count
    tools: list[Any] | None
    pair: tuple[str, str] | None  # (prompt, completion) of a plain prompt/completion record


def _bad(record: corpus.Record, problem: str, fix: str) -> FlagError:
    return FlagError('input', record.path, f'line {record.line}: {problem}', fix)


def _messages(record: corpus.Record, value: Any, what: str) -> list[dict[str, Any]]:
    """`value` checked as a non-empty list of {role, content} messages of known roles."""
    if not isinstance(value, list) or not value:
        problem = 'holds no message' if value == [] else f'is a JSON {type(value).__name__}, not a list of messages'
        raise _bad(record, f'{what} {problem}', 'write e.g. [{"role": "user", "content": "..."}, '
                   '{"role": "assistant", "content": "..."}]')
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(record, f'{what}[{i}] is a JSON {type(message).__name__}, not an object',
                       'write each message as {"role": "...", "content": "..."}')
        role, content = message.get('role'), message.get('content')
        if role not in ROLES:
            raise _bad(record, f'{what}[{i}] has the unknown role {role!r} (known: {", ".join(ROLES)})',
                       'use the roles system, user, assistant and tool (ShareGPT\'s "human" is user, "gpt" assistant)')
        if not (isinstance(content, str) or (content is None and message.get('tool_calls'))):
            raise _bad(record, f'{what}[{i}] ({role}) has content of type {type(content).__name__}, not a string',
                       'write each message\'s "content" as a string')
    return value


def parse(record: corpus.Record, loss_on: str, messages_field: str = 'messages') -> Conversation:
    """The conversation of a record (module docstring); raises FlagError naming its line."""
    value, tools = record.value, record.value.get('tools')
    if tools is not None and not isinstance(tools, list):
        raise _bad(record, f'"tools" is a JSON {type(tools).__name__}, not a list',
                   'write "tools" as a list, or drop it')
    pair = None
    if messages_field in value:
        messages, first_learned = _messages(record, value[messages_field], f'"{messages_field}"'), 0
    elif 'prompt' in value and 'completion' in value:
        prompt, completion = value['prompt'], value['completion']
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': completion}]
            first_learned = 1
            pair = (prompt, completion)
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = _messages(record, prompt, '"prompt"') + _messages(record, completion, '"completion"')
            first_learned = len(prompt)
        else:
            raise _bad(record, f'"prompt" is {type(prompt).__name__} and "completion" {type(completion).__name__}: '
                       'both must be strings, or both lists of messages',
                       'write {"prompt": "...", "completion": "..."}')
    else:
        raise _bad(record, f'has neither "{messages_field}" nor "prompt" and "completion" (its fields: '
                   f'{sorted(value)})', 'write {"messages": [{"role": "user", "content": "..."}, ...]} or '
                   '{"prompt": ..., "completion": ...}, or pass --messages_field=<the field holding the conversation>')
    assistant = [i for i, m in enumerate(messages) if m['role'] == 'assistant' and i >= first_learned]
    if not assistant:
        raise _bad(record, 'the conversation has no assistant turn' + (' in its completion' if first_learned else '')
                   + ': nothing to learn', 'give every conversation an assistant turn, or drop it from the input')
    learned = tuple(assistant[-1:] if loss_on == 'last_assistant' else assistant)
    if learned[0] == 0 and loss_on != 'all':
        raise _bad(record, 'the conversation opens with an assistant turn: there is no prompt to render before it',
                   'start the conversation with a system or user message, or --loss_on=all')
    return Conversation(messages, learned, tools, pair)


def load_tokenizer(path: str) -> Any:
    """A `transformers` tokenizer from a Hugging Face tokenizer directory (or a tokenizer.json: no template).

    Raises:
      FlagError: the directory asks to run code of its own (`auto_map`), transformers or jinja2 is missing, or
        the tokenizer cannot be loaded.
    """
    if os.path.isdir(path):
        refuse_remote_code(path, 'tokenizer')
    try:
        import jinja2  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
        import transformers  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise FlagError('sft', True, f'needs the {e.name or "transformers"} package', _INSTALL) from None
    fix = 'pass --tokenizer=DIR, a Hugging Face tokenizer directory (tokenizer.json and tokenizer_config.json)'
    if not os.path.exists(path):
        raise FlagError('tokenizer', path, 'no such file or directory', fix)
    try:
        if os.path.isdir(path):  # trust_remote_code=False: a received directory runs no code of its own
            return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        return transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as e:  # pylint: disable=broad-except  (any file a user hands us)
        raise FlagError('tokenizer', path, f'transformers cannot load it ({" ".join(str(e).split())[:200]})',
                        fix) from None


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is absent, unreadable or not an object (transformers names that)."""
    try:
        with open(path, encoding='utf-8') as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def refuse_remote_code(directory: str, flag: str) -> None:
    """A FlagError naming the file when loading a Hugging Face directory's tokenizer would run code of its own.

    transformers runs a directory's Python where an `auto_map` names it: tokenizer_config.json's `AutoTokenizer`
    entry (a list in older files), or config.json's `AutoConfig` or `AutoTokenizer` (AutoTokenizer reads the
    config too). load_tokenizer passes trust_remote_code=False, so nothing would run, but transformers' refusal
    (or its fallback) speaks of the Hub; this names the file. Entries for the model alone
    (AutoModelForCausalLM) are not the tokenizer's: jaxfrontier reads weights itself.
    """
    tokenizer_config = _json_object(os.path.join(directory, 'tokenizer_config.json'))
    auto_map = tokenizer_config.get('auto_map')
    entry = auto_map if isinstance(auto_map, list) else auto_map.get('AutoTokenizer') if isinstance(
        auto_map, dict) else None
    file = 'tokenizer_config.json'
    if not entry:
        auto_map = _json_object(os.path.join(directory, 'config.json')).get('auto_map')
        entry = {k: auto_map[k] for k in ('AutoConfig', 'AutoTokenizer') if k in auto_map} if isinstance(
            auto_map, dict) else auto_map
        file = 'config.json'
    if entry:
        raise FlagError(flag, directory, f'{os.path.join(directory, file)} asks to run code of its own ("auto_map": '
                        f'{repr(entry)[:120]}); jaxfrontier runs no code from a received directory',
                        'use a tokenizer the transformers library implements (a "tokenizer_class" it has, no '
                        '"auto_map" for the tokenizer)')


class Renderer:
    """Conversations -> (tokens, mask) with one tokenizer (module docstring)."""

    def __init__(self, tokenizer: Any, path: str):
        from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
        self.tokenizer, self.path = tokenizer, path
        self.has_template = bool(getattr(tokenizer, 'chat_template', None))
        # transformers >= 5.2x: special-token text inside a message is encoded as text, as prepare
        # encodes documents; older versions parse it as the special token (the header records which).
        self.sanitize = 'sanitize_control_tokens' in inspect.signature(tokenizer.apply_chat_template).parameters
        self.plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # pairs without a template
        self.plain.encode_special_tokens = True

    @property
    def rendering(self) -> str:
        """How conversations become text: 'chat_template', or 'concatenation' (pairs, no template)."""
        return 'chat_template' if self.has_template else 'concatenation'

    def _ids(self, record: corpus.Record, conversation: Conversation, upto: int, prompt: bool) -> list[int]:
        extra = {'sanitize_control_tokens': True} if self.sanitize else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation.messages[:upto], tools=conversation.tools, add_generation_prompt=prompt, tokenize=True,
                return_dict=False, **extra)
        except Exception as e:  # pylint: disable=broad-except  (the template is the user's code, raising anything)
            raise _bad(record, f'the chat template of {self.path} fails on the conversation '
                       f'({type(e).__name__}: {" ".join(str(e).split())[:200]})',
                       'fix the conversation (e.g. roles that alternate as the template demands), or use another '
                       'tokenizer') from None
        return list(ids)

    def render(self, record: corpus.Record, conversation: Conversation, loss_on: str) -> tuple[list[int], list[int]]:
        """(tokens, mask: 1 where the prediction of the token counts) of a conversation."""
        if not self.has_template:
            if conversation.pair is None:
                raise FlagError('tokenizer', self.path, f'has no chat template (tokenizer_config.json "chat_template") '
                                f'to render the conversation of {record.path} line {record.line}',
                                'pass the tokenizer directory of a chat model, or write prompt/completion pairs '
                                '(concatenated as plain text without a template)')
            prompt, completion = (self.plain.encode(text, add_special_tokens=False).ids for text in conversation.pair)
            return prompt + completion, [int(loss_on == 'all')] * len(prompt) + [1] * len(completion)
        tokens = self._ids(record, conversation, len(conversation.messages), False)
        if loss_on == 'all':
            return tokens, [1] * len(tokens)
        mask = [0] * len(tokens)
        for turn in conversation.learned:
            start = self._ids(record, conversation, turn, True)
            last = turn + 1 == len(conversation.messages)
            stop = tokens if last else self._ids(record, conversation, turn + 1, False)
            if tokens[:len(start)] != start or tokens[:len(stop)] != stop or len(stop) < len(start):
                raise _bad(record, f'the chat template of {self.path} renders the conversation up to message {turn} '
                           'as tokens that do not begin its whole rendering, so the assistant turn\'s tokens cannot be '
                           'found (a template that rewrites earlier turns)',
                           'use a template whose renderings extend one another, or --loss_on=all')
            mask[len(start):len(stop)] = [1] * (len(stop) - len(start))
        return tokens, mask
