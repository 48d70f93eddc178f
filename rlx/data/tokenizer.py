"""Tokenizers: sentencepiece `.model` files and Hugging Face `tokenizer.json`, one interface.

  tok = load_tokenizer("/ckpt/Qwen2.5-0.5B-Instruct")      # a model directory, or a file
  prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])   # the model's format
  ids = tok.encode(prompt)                                  # special tokens in the text are parsed
  SamplingParams(..., eos_id=tok.eos_id, stop_ids=tok.stop_ids, pad_id=tok.pad_id)

Both classes have encode(text, add_special_tokens=False) -> ids, decode(ids) -> text (up to
the first stop token, special tokens dropped), pad_id, bos_id, eos_id, stop_ids, vocab_size,
chat_template, apply_chat_template, encode_chat, save; `Tokenizer.load` / `load_tokenizer`.

Token ids and the chat template come from a Hugging Face directory's tokenizer_config.json,
special_tokens_map.json (which overrides it, as in transformers), generation_config.json (its
eos_token_id may be a list: those are the extra stop ids) or config.json, and
chat_template.jinja. Chat templates render in the same sandboxed jinja2 environment
transformers uses, so instruct models get prompts in their own format. A broken template
(syntax error, raise_exception(...), sandbox violation, a render still running after
CHAT_TEMPLATE_TIME_LIMIT_S) is a one-line ValueError that names the file it came from.

A tokenizer trained by `train_sentencepiece` has fixed special ids: pad=0, unk=1, bos=2, eos=3.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import io
import json
import os
import re
import time
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import sentencepiece as spm

from rlx.data.sentencepiece_to_hf import sentencepiece_to_tokenizers

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


# ============================================================================= HF metadata


def _token_str(value) -> str | None:
  if isinstance(value, Mapping):  # a serialized AddedToken
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
  """A JSON object file's contents; {} when the file does not exist."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                     f"{e.start}); expected a UTF-8 JSON file.") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column "
                     f"{e.colno}).") from None
  except OSError as e:
    raise ValueError(f"{path} cannot be read ({e.strerror or e}).") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds a JSON {type(value).__name__}; expected a JSON object.")
  return value


def _one_line(text: Any, limit: int = 200) -> str:
  """str(text) with whitespace runs collapsed to one space, cut to about `limit` characters."""
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to about `limit` characters (values in error messages can be huge)."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _ids(value, path: str, key: str) -> list[int]:
  if value is None:
    return []
  try:
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
  except (TypeError, ValueError):
    raise ValueError(f"{path}: {key} is {_short(value)}; expected a token id or a list of "
                     f"ids.") from None


@dataclasses.dataclass
class HFMeta:
  """What a Hugging Face model directory says about its tokenizer, besides the vocabulary."""

  special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token -> "<s>"
  add_bos_token: bool | None = None
  add_eos_token: bool | None = None
  legacy: bool | None = None
  chat_template: str | None = None
  chat_template_file: str | None = None  # named in template errors
  added_tokens: list[str] = dataclasses.field(default_factory=list)  # split out before encoding
  generation_eos_ids: list[int] = dataclasses.field(default_factory=list)
  generation_pad_id: int | None = None
  generation_bos_id: int | None = None
  tokenizer_config: dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dir(cls, directory: str) -> "HFMeta":
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json(config_path)
    special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
    gen_path = os.path.join(directory, "generation_config.json")
    gen = _read_json(gen_path)
    if not gen:  # transformers derives the generation config from config.json then
      gen_path = os.path.join(directory, "config.json")
      gen = _read_json(gen_path)
      text_config = gen.get("text_config") or {}
      if not isinstance(text_config, dict):
        raise ValueError(f"{gen_path}: text_config is {_short(text_config)}; expected a JSON "
                         f"object.")
      gen = {**text_config, **{k: v for k, v in gen.items() if v is not None}}
    special = {}
    for name in _SPECIAL_NAMES:
      value = _token_str(special_map.get(name)) or _token_str(config.get(name))
      if value is not None:
        special[name] = value
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
      raise ValueError(f"{config_path}: added_tokens_decoder is {_short(decoder)}; expected a "
                       f"JSON object {{id: token}}.")
    added = [_token_str(t) for t in decoder.values()]
    chat_template, chat_template_file = _load_chat_template(directory, config)
    return cls(
        special_tokens=special,
        add_bos_token=config.get("add_bos_token"),
        add_eos_token=config.get("add_eos_token"),
        legacy=config.get("legacy"),
        chat_template=chat_template,
        chat_template_file=chat_template_file,
        added_tokens=[t for t in added if t],
        generation_eos_ids=_ids(gen.get("eos_token_id"), gen_path, "eos_token_id"),
        generation_pad_id=(_ids(gen.get("pad_token_id"), gen_path, "pad_token_id") or [None])[0],
        generation_bos_id=(_ids(gen.get("bos_token_id"), gen_path, "bos_token_id") or [None])[0],
        tokenizer_config=config,
    )


def _load_chat_template(directory: str,
                        config: Mapping[str, Any]) -> tuple[str | None, str | None]:
  """(template, the file it came from)."""
  jinja = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja):
    try:
      with open(jinja, encoding="utf-8") as f:
        return f.read(), jinja
    except UnicodeDecodeError as e:
      raise ValueError(f"{jinja} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                       f"{e.start}); expected a UTF-8 jinja2 template.") from None
  path = os.path.join(directory, "chat_template.json")
  template = _read_json(path).get("chat_template")
  if not template:
    path = os.path.join(directory, "tokenizer_config.json")
    template = config.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
    if not all(isinstance(t, Mapping) and "name" in t and "template" in t for t in template):
      raise ValueError(f"{path}: chat_template is {_short(template)}; expected a string or a "
                       f"list of {{'name': ..., 'template': ...}}.")
    template = {t["name"]: t["template"] for t in template}.get("default")
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{path}: chat_template is {_short(template)}; expected a jinja2 template "
                     f"string.")
  return template, (path if template else None)


# ============================================================================= chat templates


# A chat template renders in well under a millisecond. The sandbox caps each range() at 100,000
# items but not loops nested in loops, so a render that runs this long is stopped.
CHAT_TEMPLATE_TIME_LIMIT_S = 10.0
_MAX_SEQUENCE = 10_000_000  # longest str / list a template may build with `*`
_MAX_POWER_BITS = 1 << 16  # largest int a template may build with `**`
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rlx_chat_template_deadline", default=None)


class _TemplateTimeout(Exception):
  """A render ran past its deadline."""


class _TemplateRaised(Exception):
  """A template called raise_exception(message)."""


@functools.cache
def _environment():
  """transformers' chat-template environment, plus a time budget checked in every block."""
  try:
    from jinja2 import compiler, ext, nodes, sandbox  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Chat templates need jinja2: pip install 'jinja2>=3.1'.") from e

  class GenerationTag(ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders the body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  class BudgetedCodeGenerator(compiler.CodeGenerator):
    """Compiles a deadline check into every block body, so into every loop iteration."""

    def blockvisit(self, body, frame):
      self.writeline("environment.check_deadline()")
      super().blockvisit(body, frame)

  class Environment(sandbox.ImmutableSandboxedEnvironment):
    code_generator_class = BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "**"})  # single C calls the deadline cannot stop

    def check_deadline(self):
      deadline = _DEADLINE.get()
      if deadline is not None and time.monotonic() > deadline:
        raise _TemplateTimeout()

    def call_binop(self, context, operator, left, right):
      if (operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0
          and abs(left).bit_length() * right > _MAX_POWER_BITS):
        raise sandbox.SecurityError(f"{_short(left)} ** {_short(right)} is too large.")
      if operator == "*":
        for seq, times in ((left, right), (right, left)):
          if (isinstance(seq, (str, list, tuple)) and isinstance(times, int)
              and len(seq) * times > _MAX_SEQUENCE):
            raise sandbox.SecurityError(f"repeating a {type(seq).__name__} of length "
                                        f"{len(seq)} {times} times is too large.")
      return super().call_binop(context, operator, left, right)

  def raise_exception(message):
    raise _TemplateRaised(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers: no HTML escaping, and the json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = Environment(trim_blocks=True, lstrip_blocks=True,
                    extensions=[GenerationTag, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
  return _environment().from_string(template)


def _template_line(error: BaseException) -> str:
  """' at line N' of the template where `error` was raised, or ''."""
  line = getattr(error, "lineno", None)
  tb = error.__traceback__
  while tb is not None:  # jinja2 rewrites tracebacks so template frames carry template lines
    if tb.tb_frame.f_code.co_filename == "<template>":
      line = tb.tb_lineno
    tb = tb.tb_next
  return f" at line {line}" if line else ""


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True,
                         special_tokens: Mapping[str, str] | None = None,
                         tools: list[dict] | None = None, template_file: str | None = None,
                         time_limit_s: float | None = None, **kwargs) -> str:
  """Renders a Hugging Face chat template exactly as transformers' apply_chat_template does.

  A broken template (syntax error, raise_exception(...), a sandbox violation, a render longer
  than time_limit_s, default CHAT_TEMPLATE_TIME_LIMIT_S) raises a one-line ValueError that
  names template_file.
  """
  _environment()  # a clear ImportError without jinja2
  import jinja2.sandbox  # pylint: disable=g-import-not-at-top
  for m in messages:
    if not isinstance(m, Mapping) or "role" not in m:
      raise ValueError(f"Chat message {_short(m)}: expected a dict with 'role' and 'content'.")
  where = f"The chat template in {template_file}" if template_file else "The chat template"
  try:
    compiled = _compile_template(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"{where} is not valid jinja2{_template_line(e)}: "
                     f"{_one_line(e.message)}") from e
  limit = CHAT_TEMPLATE_TIME_LIMIT_S if time_limit_s is None else time_limit_s
  token = _DEADLINE.set(time.monotonic() + limit)
  try:
    return compiled.render(
        messages=[dict(m) for m in messages], tools=tools, documents=None,
        add_generation_prompt=add_generation_prompt, **{**dict(special_tokens or {}), **kwargs})
  except _TemplateTimeout:
    raise ValueError(f"{where} was still rendering after {limit:g} s; expected it to finish in "
                     f"milliseconds (look for loops nested in loops).") from None
  except jinja2.sandbox.SecurityError as e:
    raise ValueError(f"{where} did something the sandbox forbids{_template_line(e)}: "
                     f"{_one_line(e)}") from e
  except _TemplateRaised as e:  # e.g. "Conversation roles must alternate user/assistant/..."
    raise ValueError(f"{where} raised an error{_template_line(e)}: {_one_line(e)}") from e
  except Exception as e:  # pylint: disable=broad-except  # undefined names, 1/0, 'a' + 1, ...
    raise ValueError(f"{where} failed{_template_line(e)}: {type(e).__name__}: "
                     f"{_one_line(e)}") from e
  finally:
    _DEADLINE.reset(token)


class _Common:
  """Chat template, stop ids and special-id resolution shared by both tokenizers."""

  meta: HFMeta | None
  pad_id: int
  bos_id: int | None
  eos_id: int | None
  stop_ids: tuple[int, ...]

  @property
  def chat_template(self) -> str | None:
    return self.meta.chat_template if self.meta else None

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text for `messages` in the model's own format (transformers semantics)."""
    if not self.chat_template:
      raise ValueError("This tokenizer has no chat template (no chat_template in "
                       "tokenizer_config.json and no chat_template.jinja).")
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                special_tokens=self.meta.special_tokens,
                                template_file=self.meta.chat_template_file or self.path,
                                **kwargs)

  def encode_chat(self, messages, *, add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Token ids of the rendered chat (as transformers: no special tokens added on top)."""
    return self.encode(self.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=add_generation_prompt, **kwargs))

  def _resolve_ids(self, token_id, default_pad: int):
    """Sets bos/eos/pad/stop ids from the metadata; token_id(str) -> int | None."""
    meta = self.meta
    special = meta.special_tokens
    named = {k: token_id(v) for k, v in special.items()}
    self.bos_id = named.get("bos_token")
    if self.bos_id is None:
      self.bos_id = meta.generation_bos_id if "bos_token" not in special else None
    eos = named.get("eos_token")
    if eos is None and meta.generation_eos_ids:
      eos = meta.generation_eos_ids[0]
    self.eos_id = eos
    stops = ([eos] if eos is not None else []) + meta.generation_eos_ids
    self.stop_ids = tuple(dict.fromkeys(stops))
    pad = named.get("pad_token")
    if pad is None:
      pad = meta.generation_pad_id
    if pad is None:
      pad = eos if eos is not None else default_pad
    self.pad_id = pad


# ============================================================================= sentencepiece


class Tokenizer(_Common):
  """A sentencepiece model (text <-> ids), optionally with a Hugging Face directory's metadata.

  Without metadata (models from `train_sentencepiece`), ids come from the model and
  add_special_tokens=True prepends bos. With metadata, plain text encodes as transformers'
  Llama/Gemma tokenizers do (a leading space is not doubled by the dummy prefix; special
  token strings in the text become their ids).
  """

  def __init__(self, model_proto: bytes, path: str | None = None, meta: HFMeta | None = None):
    self.path = path
    self.meta = meta
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except Exception as e:  # sentencepiece raises RuntimeError / OSError on bad bytes
      where = f" {path!r}" if path else ""
      raise ValueError(f"Tokenizer file{where} is not a valid sentencepiece model ({e}).") from e
    self._proto = model_proto
    self.pad_id = self._sp.pad_id()
    self.bos_id = self._sp.bos_id()
    self.eos_id = self._sp.eos_id()
    self.stop_ids = (self.eos_id,)
    self._add_bos = True
    self._add_eos = False
    self._special_re = None
    self._sp_no_prefix = None
    if meta is not None:
      self._resolve_ids(self._piece_id, default_pad=max(self._sp.pad_id(), 0))
      self._add_bos = True if meta.add_bos_token is None else bool(meta.add_bos_token)
      self._add_eos = bool(meta.add_eos_token)
      specials = [t for t in list(meta.special_tokens.values()) + meta.added_tokens
                  if self._piece_id(t) is not None]
      if specials:
        self._special_re = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(set(specials), key=len, reverse=True)) + ")")

  def _piece_id(self, piece: str) -> int | None:
    i = self._sp.piece_to_id(piece)
    return i if self._sp.id_to_piece(i) == piece else None

  @functools.cached_property
  def _dummy_prefix(self) -> bool:
    from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(self._proto)
    if proto.normalizer_spec.add_dummy_prefix:
      proto.normalizer_spec.add_dummy_prefix = False
      self._sp_no_prefix = spm.SentencePieceProcessor()
      self._sp_no_prefix.LoadFromSerializedProto(proto.SerializeToString())
      return True
    return False

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    if not os.path.exists(path):
      raise FileNotFoundError(f"Tokenizer file {path!r} does not exist.")
    with open(path, "rb") as f:
      return cls(f.read(), path=path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def _encode_plain(self, text: str, first: bool) -> list[int]:
    if self.meta is None or not text:
      return list(self._sp.encode(text)) if text or self.meta is None else []
    if not self._dummy_prefix:
      return list(self._sp.encode(text))
    # transformers' Metaspace adds the "▁" prefix only where the text does not already start
    # with a space, and unless legacy=True only before the first segment.
    prefix = (first or self.meta.legacy is True) and not text.startswith(" ")
    return list((self._sp if prefix else self._sp_no_prefix).encode(text))

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    if self._special_re is None:
      ids = self._encode_plain(text, True)
    else:
      ids = []
      for k, part in enumerate(self._special_re.split(text)):
        if k % 2:
          ids.append(self._piece_id(part))
        elif part:
          ids += self._encode_plain(part, first=(k == 0))
    if add_special_tokens:
      if self._add_bos and self.bos_id is not None and self.bos_id >= 0:
        ids = [self.bos_id] + ids
      if self._add_eos and self.eos_id is not None and self.eos_id >= 0:
        ids = ids + [self.eos_id]
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    stops = [k for k, i in enumerate(ids) if i in self.stop_ids]
    if stops:
      ids = ids[:stops[0]]
    drop = {self.pad_id, self.bos_id}
    ids = [i for i in ids if i not in drop and not self._sp.is_control(i)]
    return self._sp.decode(ids)

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def save(self, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(self._sp.serialized_model_proto())
    os.replace(tmp, path)

  def save_pretrained(self, directory: str) -> None:
    """Writes a Hugging Face tokenizer directory that encodes and decodes as this tokenizer.

    tokenizer.model, plus tokenizer.json (the sentencepiece model converted for the
    `tokenizers` library, see `sentencepiece_to_tokenizers`, with bos prepended by its
    post-processor), tokenizer_config.json (class, special tokens, add_bos_token) and
    special_tokens_map.json: `transformers.AutoTokenizer.from_pretrained(directory)` then gives
    encode(text, add_special_tokens=True)'s ids for `tokenizer(text)`, and the same text back
    from decode(ids, skip_special_tokens=True). Differences remain in corners: the fast
    tokenizer reads control-token strings typed in the text ("<s>") as those tokens
    (sentencepiece spells them out), and a byte-fallback model's invalid UTF-8 byte runs
    decode to a different number of U+FFFD. Only for a tokenizer without Hugging Face
    metadata (`train_sentencepiece`, a bare `.model` file); one loaded from a Hugging Face
    directory has its own files.
    """
    if self.meta is not None:
      raise ValueError("save_pretrained writes the files of a bare sentencepiece model; this "
                       "tokenizer was read from a Hugging Face directory: copy its files.")
    import tokenizers  # pylint: disable=g-import-not-at-top
    tok = sentencepiece_to_tokenizers(self._sp.serialized_model_proto())
    special = {}
    # No unk_token: transformers would make it special, and decode would drop the " ⁇ "
    # sentencepiece shows for it (the converted model still encodes unknown text as <unk>).
    for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                    ("pad_token", self.pad_id)):
      if i is not None and 0 <= i < self.vocab_size:
        special[name] = self._sp.id_to_piece(i)
    add_bos = self._add_bos and "bos_token" in special
    if add_bos:
      bos = special["bos_token"]
      tok.post_processor = tokenizers.processors.TemplateProcessing(
          single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
          special_tokens=[(bos, self.bos_id)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "add_bos_token": add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False}
    os.makedirs(directory, exist_ok=True)
    self.save(os.path.join(directory, "tokenizer.model"))
    tok.save(os.path.join(directory, "tokenizer.json"))
    for name, value in (("tokenizer_config.json", config),
                        ("special_tokens_map.json", special)):
      with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def train_sentencepiece(texts: Iterable[str], vocab_size: int = 64,
                        symbols: Sequence[str] = ()) -> Tokenizer:
  """BPE with digits split into single tokens (so numbers tokenize one digit per token).

  symbols: strings that always encode as one token of their own, whatever surrounds them
  (e.g. a task's final-answer marker, which a verifier then finds by its id).
  """
  model = io.BytesIO()
  extra = {"user_defined_symbols": list(symbols)} if symbols else {}
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=model,
      model_type="bpe",
      vocab_size=vocab_size,
      hard_vocab_limit=False,
      split_digits=True,
      add_dummy_prefix=False,
      character_coverage=1.0,
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      num_threads=1,
      minloglevel=2,
      **extra,
  )
  return Tokenizer(model.getvalue())


# ============================================================================= tokenizer.json


class HFTokenizer(_Common):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library), with the directory's metadata.

  encode(text) gives the ids transformers' fast tokenizer gives for the same tokenizer.json
  (special tokens in the text are parsed); add_special_tokens=True applies the
  post-processor (e.g. Llama 3's <|begin_of_text|>). bos_id is None for models without one
  (Qwen). decode keeps spaces as they are (no clean_up_tokenization_spaces).
  """

  def __init__(self, path: str, meta: HFMeta | None = None):
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("tokenizer.json needs the `tokenizers` package: pip install "
                        "tokenizers") from e
    if not os.path.exists(path):
      raise FileNotFoundError(f"Tokenizer file {path!r} does not exist.")
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise ValueError(f"{path} is not a valid tokenizer.json ({e}).") from e
    self.path = path
    self.meta = meta if meta is not None else HFMeta()
    # transformers adds named special tokens missing from the vocabulary as special tokens.
    missing = [t for t in self.meta.special_tokens.values() if self._tok.token_to_id(t) is None]
    if missing:
      self._tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])
    self._resolve_ids(self._tok.token_to_id, default_pad=0)
    if (self.meta.add_bos_token is not None or self.meta.add_eos_token is not None
        or self._tok.post_processor is None):
      self._update_post_processor(tokenizers)

  def _update_post_processor(self, tokenizers):
    """transformers' TokenizersBackend.update_post_processor: bos/eos from the config flags."""
    bos = self.meta.special_tokens.get("bos_token")
    eos = self.meta.special_tokens.get("eos_token")
    add_bos = bool(self.meta.add_bos_token) and bos is not None
    add_eos = bool(self.meta.add_eos_token) and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = (f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1"
            f"{(' ' + eos + ':1') if add_eos else ''}")
    special = []
    if add_bos:
      special.append((bos, self._tok.token_to_id(bos)))
    if add_eos:
      special.append((eos, self._tok.token_to_id(eos)))
    self._tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special)

  @classmethod
  def load(cls, path: str) -> "HFTokenizer":
    directory = os.path.dirname(path) if os.path.isfile(path) else path
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    return cls(file, HFMeta.from_dir(directory))

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    stops = [k for k, i in enumerate(ids) if i in self.stop_ids]
    if stops:
      ids = ids[:stops[0]]
    return self._tok.decode(ids, skip_special_tokens=True)

  def id_to_piece(self, i: int) -> str:
    return self._tok.id_to_token(int(i))

  def save(self, directory: str) -> None:
    """Writes tokenizer.json, tokenizer_config.json (+ chat_template.jinja) into directory."""
    os.makedirs(directory, exist_ok=True)
    self._tok.save(os.path.join(directory, "tokenizer.json"))
    config = dict(self.meta.tokenizer_config)
    config.update(self.meta.special_tokens)
    config.pop("chat_template", None)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    if self.chat_template:
      with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(self.chat_template)


# ============================================================================= loading


def load_tokenizer(path: str) -> Tokenizer | HFTokenizer:
  """A tokenizer from a `.model` file, a `tokenizer.json` file or a model directory.

  In a directory, tokenizer.json wins over tokenizer.model (as in transformers, which uses
  the fast tokenizer by default); the directory's json files supply ids and chat template.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"Tokenizer path {path!r} does not exist.")
  if os.path.isfile(path):
    if path.endswith(".json"):
      return HFTokenizer.load(path)
    tok = Tokenizer.load(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
      with open(path, "rb") as f:
        return Tokenizer(f.read(), path=path, meta=HFMeta.from_dir(directory))
    return tok
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    return HFTokenizer.load(path)
  model = os.path.join(path, "tokenizer.model")
  if os.path.exists(model):
    with open(model, "rb") as f:
      return Tokenizer(f.read(), path=model, meta=HFMeta.from_dir(path))
  raise FileNotFoundError(f"{path} has neither tokenizer.json nor tokenizer.model.")
