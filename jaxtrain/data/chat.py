"""Chat and prompt/completion rows as token ids plus a loss mask that covers only what the model should learn.

Instruction fine-tuning trains on conversations, but the loss belongs on the assistant's replies only: the
system prompt and the user's turns are context, and learning to write them teaches the model to talk to
itself. This module turns a conversation into the exact token ids the model will see at inference (the
model's own Jinja chat template, rendered the way Hugging Face transformers renders it) and a mask that is
true on the assistant's tokens:

- `load_chat_template` reads the template from a Hugging Face tokenizer directory (`chat_template.jinja`,
  or `chat_template` in `tokenizer_config.json`); `load_template_tokens` reads the `bos_token`/`eos_token`
  strings the template may refer to.
- `render` renders a template like `transformers.utils.chat_template_utils` does (same sandbox, options,
  globals and `{% generation %}` tag), returning the text and the character spans of generated text.
- `assistant_spans` finds the assistant characters: from the template's `{% generation %}` blocks when it
  has them, else by rendering the conversation prefix by prefix; `assistant_mask` maps character spans to
  tokens through the tokenizer's offsets, as `apply_chat_template(..., return_assistant_tokens_mask=True)`
  does.
- `encode_chat` and `encode_prompt_completion` give `(ids int32, mask bool)` for one row.

transformers is not imported (it is a test-only dependency); the tests check this module against it. Chat
templates come from model repositories and are untrusted code, so they run in Jinja's immutable sandbox,
which needs jinja2 >= 3.1.6 (older releases have known sandbox escapes; transformers requires the same).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.config import ConfigError

Span = tuple[int, int]  # [start, end) character indices into the rendered text
# The keys of a tokenizer_config.json whose strings transformers passes to every chat template.
TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' test for a template with generation blocks (render_jinja_template).
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# Older names for a message's reasoning; transformers copies the first one set to `thinking` and
# `reasoning_content`, the names templates read (chat_template_utils._alias_reasoning_fields).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_MIN_JINJA = (3, 1, 6)


# ---- loading ------------------------------------------------------------------------------------------


def _tokenizer_dir_and_config(path: str | Path) -> tuple[Path, Path]:
    """The directory to look for `chat_template.jinja` in, and the tokenizer_config.json to read."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p, p / "tokenizer_config.json"
    # `data.tokenizer` names tokenizer.json; its template lives in the tokenizer_config.json beside it.
    if p.name == "tokenizer.json":
        return p.parent, p.parent / "tokenizer_config.json"
    return p.parent, p


def _read_config(config: Path) -> dict:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"tokenizer config '{config}' does not read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"tokenizer config '{config}' is not a JSON object")
    return data


def load_chat_template(tokenizer_dir_or_file: str | Path) -> str:
    """The chat template of a Hugging Face tokenizer, found where transformers looks for it.

    Args:
      tokenizer_dir_or_file: a tokenizer directory, its `tokenizer.json` or `tokenizer_config.json`, or a
        `.jinja` template file.
    Returns:
      The Jinja source. `chat_template.jinja` beside the config wins over the config's `chat_template`
      (transformers' order); of the list form `[{"name": ..., "template": ...}]` the one named `default`.
    Raises:
      ConfigError: no template there (the message names the file), or the config does not read.
    """
    p = Path(tokenizer_dir_or_file).expanduser()
    if p.is_file() and p.suffix == ".jinja":
        return p.read_text(encoding="utf-8")
    if not p.exists():
        raise ConfigError(f"no chat template: '{p}' does not exist")
    folder, config = _tokenizer_dir_and_config(p)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # the layout transformers >= 4.51 saves; it takes priority on load
        return jinja_file.read_text(encoding="utf-8")
    if not config.is_file():
        raise ConfigError(f"no chat template: '{config}' does not exist and there is no '{jinja_file}'")
    template = _read_config(config).get("chat_template")
    if template is None:
        raise ConfigError(f"no chat template: '{config}' has no chat_template and there is no '{jinja_file}'")
    if isinstance(template, list):  # older files keep several named templates in a list
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"'{config}' has several chat templates ({sorted(map(str, named))}) and none named "
                              f"'default'")
        template = named["default"]
    elif isinstance(template, dict):
        if "default" not in template:
            raise ConfigError(f"'{config}' has several chat templates ({sorted(template)}) and none named 'default'")
        template = template["default"]
    if not isinstance(template, str) or not template:
        raise ConfigError(f"'{config}': chat_template is not a non-empty string")
    return template


def load_template_tokens(tokenizer_dir_or_file: str | Path) -> dict[str, str]:
    """The special-token strings (`bos_token`, `eos_token`, ...) of a tokenizer_config.json that sets them.

    transformers passes these to every chat template (Llama-style templates start with `{{ bos_token }}`);
    pass the result to `render`/`encode_chat` as keyword arguments. A token saved as an AddedToken object
    (`{"content": ...}`) gives its content; a missing config gives {}.
    """
    _, config = _tokenizer_dir_and_config(Path(tokenizer_dir_or_file).expanduser())
    if not config.is_file():
        return {}
    data = _read_config(config)
    tokens = {}
    for key in TEMPLATE_TOKEN_KEYS:
        value = data.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


# ---- rendering ----------------------------------------------------------------------------------------


class _Tracking:
    """Where the render is (characters yielded so far) and the generation spans seen, for one render."""

    def __init__(self) -> None:
        self.chars = 0
        self.spans: list[Span] = []


# One per thread or task: data-loading workers may render concurrently with the same compiled template.
_TRACKING: ContextVar[_Tracking | None] = ContextVar("jaxtrain_chat_tracking", default=None)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    """The Jinja environment transformers renders chat templates in (chat_template_utils._compile_jinja_template)."""
    try:
        import jinja2
        import jinja2.exceptions
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from None
    version = tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < _MIN_JINJA:
        raise ConfigError(f"chat templates need jinja2 >= 3.1.6, found {jinja2.__version__} (older releases have "
                          f"sandbox escapes, and templates are untrusted code): pip install -U jinja2")

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of the text inside."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                # Like transformers: the span starts where the output stands when the block runs, which is
                # right as long as the block writes straight to the output (not into a macro or a `set`).
                tracking.spans.append((tracking.chars, tracking.chars + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the rendered prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """`dict(...)` for templates, without the class itself (no attribute access to break out through)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        # Underscore attributes on a namespace are a way towards CPython internals.
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The compiled template (cached: every row of a data set renders the same one)."""
    env = _environment()
    try:
        return env.from_string(template)
    except Exception as e:  # noqa: BLE001 -- TemplateSyntaxError, or an extension's parse error
        line = getattr(e, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ConfigError(f"the chat template does not parse{where}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _normalize(messages: Sequence[Any]) -> list[dict]:
    """The messages as transformers hands them to templates: keys with None values dropped (templates test
    `'key' in message`, not for None), reasoning copied to the names templates read; fresh dicts."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"chat message {i} is not an object with 'role' and 'content', got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = False,
           bos_token: str | None = None, eos_token: str | None = None, **variables: Any) -> tuple[str, list[Span]]:
    """Render a conversation with a chat template as transformers' `apply_chat_template` does.

    Args:
      template: the Jinja source (`load_chat_template`).
      messages: dicts with `role` and `content` (and whatever else the template reads).
      add_generation_prompt: end with the header that opens an assistant turn.
      bos_token, eos_token, variables: strings the template may refer to (`load_template_tokens`); one left
        None is undefined in the template, as when the tokenizer does not set it.
    Returns:
      The text, and the [start, end) character spans of every `{% generation %}` block in rendering order
      (none when the template has no such blocks).
    Raises:
      ConfigError: the template does not parse, or fails on these messages (its `raise_exception`, or any
        error while rendering), or jinja2 is missing or too old.
    """
    compiled = _compile(template)
    values = {k: v for k, v in dict(variables, bos_token=bos_token, eos_token=eos_token).items() if v is not None}
    # transformers always passes `tools` and `documents` (None unless given); templates test them.
    values.setdefault("tools", None)
    values.setdefault("documents", None)
    tracking = _Tracking()
    reset = _TRACKING.set(tracking)
    try:
        blocks = []
        for block in compiled.generate(messages=_normalize(messages), add_generation_prompt=add_generation_prompt,
                                       **values):
            blocks.append(block)
            tracking.chars += len(block)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- raise_exception (TemplateError), a sandbox refusal, a type error
        raise ConfigError(f"the chat template fails on this conversation: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        _TRACKING.reset(reset)
    return "".join(blocks), tracking.spans


def has_generation_blocks(template: str) -> bool:
    """Whether the template marks generated text with `{% generation %}` (transformers' own test)."""
    return bool(_GENERATION_TAG.search(template))


# ---- masks --------------------------------------------------------------------------------------------


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def assistant_spans(template: str, messages: Sequence[dict], **variables: Any) -> tuple[str, list[Span]]:
    """The rendered conversation and the character spans of its assistant turns.

    With `{% generation %}` blocks, the spans are the blocks' (exactly what transformers masks). Without
    them, each assistant turn is what rendering `messages[:k+1]` adds to rendering `messages[:k]` with the
    generation prompt: the reply and its end-of-turn marker, never the header that the prompt already
    gave. That holds only if every prefix renders as a prefix of the whole conversation; templates that
    write earlier turns differently once later ones exist (dropping old reasoning, counting messages) are
    refused rather than given a mask that is off by some characters.

    Args:
      template: the Jinja source.
      messages: the conversation; at least one message has role `assistant`.
      variables: `bos_token`, `eos_token` and other template variables (see `render`).
    Returns:
      (text, spans): the full rendering (no generation prompt) and [start, end) spans in order.
    Raises:
      ConfigError: no assistant turn, generation blocks that mark nothing, a template that cannot yield
        a mask by prefixes, or a template error.
    """
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
        raise ConfigError(f"a chat row has no assistant turn to learn from (roles: {roles})")
    text, spans = render(template, messages, **variables)
    if has_generation_blocks(template):
        if not any(end > start for start, end in spans):
            raise ConfigError("the chat template's {% generation %} blocks marked no text of a conversation that has "
                              "an assistant turn (are the blocks inside a branch this conversation never takes?)")
        return text, spans
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = render(template, messages[:k], add_generation_prompt=True, **variables)
        after, _ = render(template, messages[:k + 1], **variables)
        for part, what in ((before, f"the first {k} messages with the generation prompt"),
                           (after, f"the first {k + 1} messages")):
            if not text.startswith(part):
                i = _first_difference(part, text)
                raise ConfigError(
                    f"the chat template cannot yield an assistant mask: rendering {what} is not a prefix of rendering "
                    f"the whole conversation (character {i}: {part[i:i + 40]!r} there, {text[i:i + 40]!r} in the "
                    f"whole), so the template writes earlier turns differently once later ones follow; wrap the "
                    f"assistant text in {{% generation %}}...{{% endgeneration %}} in the template")
        if len(after) < len(before):
            raise ConfigError(
                f"the chat template cannot yield an assistant mask: its generation prompt before message {k} "
                f"({before[len(after):][:40]!r}) is not how it renders the assistant turn; wrap the assistant text "
                f"in {{% generation %}}...{{% endgeneration %}} in the template")
        spans.append((len(before), len(after)))
    return text, spans


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """The tokens that overlap a character span, as a bool array over `offsets` (one (start, end) per token).

    The same rule as transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`: a token is
    in when any of its characters is, so a token that straddles a span's edge is in, and all the tokens of
    one character (byte-level BPE splits an emoji into several tokens with the same offsets) are in. Spans
    and offsets are both in order, so one pass does it.
    """
    mask = np.zeros(len(offsets), dtype=bool)
    ordered = sorted(spans)
    s = 0
    for t, (start, end) in enumerate(offsets):
        while s < len(ordered) and start >= ordered[s][1]:
            s += 1
        if s == len(ordered):
            break
        if end > ordered[s][0]:
            mask[t] = True
    return mask


# ---- encoding -----------------------------------------------------------------------------------------


def _ids_and_offsets(tokenizer: Any, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Token ids of `text` (no special tokens added) and each token's character span in it."""
    if getattr(tokenizer, "name", None) == "bytes":
        # ByteTokenizer: every UTF-8 byte of a character is a token spanning that character (same
        # `errors="replace"` as ByteTokenizer.encode_batch, which turns one lone surrogate into one '?').
        data = text.encode("utf-8", errors="replace")
        widths = [len(c.encode("utf-8", errors="replace")) for c in text]
        offsets = [(i, i + 1) for i, w in enumerate(widths) for _ in range(w)]
        return np.frombuffer(data, np.uint8).astype(np.int32), offsets
    # HFTokenizer keeps the `tokenizers.Tokenizer` as `_tok`; a bare `tokenizers.Tokenizer` works as well.
    tok = getattr(tokenizer, "_tok", tokenizer)
    if not hasattr(tok, "encode"):
        raise TypeError(f"encode_chat needs an HFTokenizer, a tokenizers.Tokenizer or the bytes tokenizer, "
                        f"got {type(tokenizer).__name__}")
    enc = tok.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, dtype=np.int32), list(enc.offsets)


def encode_chat(tokenizer: Any, template: str, messages: Sequence[dict], **variables: Any) -> tuple[np.ndarray, np.ndarray]:
    """One conversation as token ids and a mask that is true on the assistant's tokens.

    Args:
      tokenizer: an `HFTokenizer` (or `tokenizers.Tokenizer`), or the bytes tokenizer.
      template: the chat template (`load_chat_template`).
      messages: the conversation, with at least one assistant turn.
      variables: `bos_token`, `eos_token` ... (`load_template_tokens`).
    Returns:
      (ids int32, mask bool) of equal length. With an HF tokenizer and a template with `{% generation %}`
      blocks both equal transformers' `apply_chat_template(messages, tokenize=True, return_dict=True,
      return_assistant_tokens_mask=True)`; nothing is appended (no end-of-document id).
    Raises:
      ConfigError: see `assistant_spans`.
    """
    text, spans = assistant_spans(template, messages, **variables)
    ids, offsets = _ids_and_offsets(tokenizer, text)
    mask = assistant_mask(offsets, spans)
    if not mask.any():  # e.g. an assistant turn that renders to no text at all
        raise ConfigError("a chat row's assistant turns cover no tokens (empty replies?)")
    return ids, mask


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A prompt/completion row as `prompt + completion + [eos_id]`, masked on the completion and the eos.

    The two texts are tokenized apart, so no token spans the boundary and the mask is exact; the ids
    can differ from tokenizing the joined text where a merge would cross the boundary (the same choice
    as TRL's prompt-completion data). The eos is learned so that the model learns to stop.
    """
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ConfigError(f"a prompt/completion row needs two strings, got {type(prompt).__name__} and "
                          f"{type(completion).__name__}")
    p, _ = _ids_and_offsets(tokenizer, prompt)
    c, _ = _ids_and_offsets(tokenizer, completion)
    ids = np.concatenate([p, c, np.asarray([eos_id], np.int32)]).astype(np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(p):] = True
    return ids, mask
