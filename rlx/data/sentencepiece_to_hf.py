"""A sentencepiece model as a Hugging Face `tokenizers.Tokenizer` (for `Tokenizer.save_pretrained`).

The conversion transformers makes for a sentencepiece file with no tokenizer class of its own,
in its four parts: the model (BPE merges or unigram scores), the normalizer, the
pre-tokenizer and the decoder. `tokenizers` and sentencepiece's protobuf are imported only
when a conversion runs.
"""

from __future__ import annotations

import re

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # sentencepiece ModelProto.SentencePiece.Type


def sentencepiece_to_tokenizers(model_proto: bytes):
  """A sentencepiece model (BPE or unigram) as a `tokenizers.Tokenizer` that encodes as
  `SentencePieceProcessor.encode` does, and decodes as its decode (control and unknown
  pieces dropped).

  The conversion transformers makes for a sentencepiece file with no tokenizer class of its
  own: the normalizer spec (precompiled charmap, extra-whitespace removal, whitespace
  escaping, dummy prefix), BPE merges ranked by piece score, user-defined pieces emitted
  whole, control pieces as special tokens, the unknown piece decoded as sentencepiece shows
  it (" ⁇ "). No post-processor: bos is the caller's choice.
  """
  # pylint: disable=g-import-not-at-top
  import tokenizers
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model_proto)
  trainer, norm = proto.trainer_spec, proto.normalizer_spec
  pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
  unk_piece = pieces[trainer.unk_id][0] if 0 <= trainer.unk_id < len(pieces) else None
  user_defined = [p for p, _, t in pieces if t == _USER_DEFINED]
  tok = tokenizers.Tokenizer(_model(trainer, pieces, unk_piece, user_defined))
  tok.normalizer = _normalizer(norm)
  pre = _pre_tokenizer(norm, user_defined)
  if pre is not None:
    tok.pre_tokenizer = pre
  tok.decoder = _decoder(norm, trainer.byte_fallback, unk_piece)
  # Control pieces (<s>, </s>, <pad>) are special: decode(skip_special_tokens=True) drops them
  # as sentencepiece does. The unknown piece is not: sentencepiece shows it.
  tok.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                          for p, _, t in pieces if t == _CONTROL])
  return tok


def _model(trainer, pieces: list[tuple[str, float, int]], unk_piece: str | None,
           user_defined: list[str]):
  """BPE with merges ranked by piece score, or unigram with the pieces' scores."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  if trainer.model_type == 2:  # BPE
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    scored = {p: (s, i) for i, (p, s, t) in enumerate(pieces) if t == _NORMAL}
    ranked = sorted((-scored[p][0], scored[p][1], p[:k], p[k:]) for p in scored
                    for k in range(1, len(p)) if p[:k] in scored and p[k:] in scored)
    return tokenizers.models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked],
                                 unk_token=unk_piece, fuse_unk=True,
                                 byte_fallback=trainer.byte_fallback,
                                 ignore_merges=bool(user_defined))
  if trainer.model_type == 1:  # unigram
    return tokenizers.models.Unigram([(p, s) for p, s, _ in pieces], unk_id=trainer.unk_id,
                                     byte_fallback=trainer.byte_fallback)
  raise ValueError(f"sentencepiece model_type {trainer.model_type} (char / word) has no "
                   "tokenizers conversion; expected BPE or unigram.")


def _normalizer(norm):
  """The normalizer spec: precompiled charmap, extra-whitespace removal, whitespace escaping,
  dummy prefix."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import normalizers  # pylint: disable=g-import-not-at-top
  steps = []
  if norm.precompiled_charsmap:
    steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
  if norm.remove_extra_whitespaces:  # spaces only: sentencepiece leaves newlines alone
    steps += [normalizers.Replace(tokenizers.Regex(r"\A +| +\z"), ""),
              normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]
  if norm.escape_whitespaces:
    steps.append(normalizers.Replace(" ", "▁"))
  if norm.add_dummy_prefix:  # Metaspace adds no prefix where one is, sentencepiece always does
    steps.append(normalizers.Replace(tokenizers.Regex(r"\A▁"), "▁▁"))
  return normalizers.Sequence(steps)


def _pre_tokenizer(norm, user_defined: list[str]):
  """The dummy prefix, and user-defined pieces split off whole; None where neither applies."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  pre = []
  if norm.add_dummy_prefix:
    pre.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False))
  if user_defined:  # matched whole, never merged, wherever they are
    pre.append(pre_tokenizers.Split(tokenizers.Regex("|".join(
        re.escape(p) for p in sorted(user_defined, key=len, reverse=True))), "isolated"))
  return pre_tokenizers.Sequence(pre) if pre else None


def _decoder(norm, byte_fallback: bool, unk_piece: str | None):
  """sentencepiece's decode: the unknown piece shows as " ⁇ " (spaces included, also at the
  start; "⁇" is in no piece, NFKC makes it "??"), and, while nothing has been output, each
  piece loses a leading "▁" (so a lone "▁" piece there vanishes) when the model adds a dummy
  prefix or removes extra whitespace. U+E000 marks a lone "▁" piece until then."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders  # pylint: disable=g-import-not-at-top
  strip = norm.add_dummy_prefix or norm.remove_extra_whitespaces
  dec = [decoders.Replace(unk_piece, "\u2047")] if unk_piece else []
  if strip:
    dec.append(decoders.Replace(tokenizers.Regex(r"\A▁\z"), "\ue000"))
  dec.append(decoders.Replace("▁", " "))
  if byte_fallback:
    dec.append(decoders.ByteFallback())
  if strip or byte_fallback or unk_piece:
    dec.append(decoders.Fuse())  # one string: the replacements below act on the whole text
  if strip:
    dec += [decoders.Replace(tokenizers.Regex("\\A\ue000* ?"), ""),
            decoders.Replace("\ue000", " ")]
  if unk_piece:
    dec.append(decoders.Replace("\u2047", " \u2047 "))
  return decoders.Sequence(dec)
