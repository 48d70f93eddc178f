"""Tokenizers: a sentencepiece model trained locally on a task's text.

Special ids are fixed so that every rlx tokenizer agrees: pad=0, unk=1, bos=2, eos=3.
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Sequence

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
  """Thin interface over a sentencepiece model (text <-> ids)."""

  def __init__(self, model_proto: bytes, path: str | None = None):
    self.path = path
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except Exception as e:  # sentencepiece raises RuntimeError / OSError on bad bytes
      where = f" {path!r}" if path else ""
      raise ValueError(f"Tokenizer file{where} is not a valid sentencepiece model ({e}).") from e
    self.pad_id = self._sp.pad_id()
    self.bos_id = self._sp.bos_id()
    self.eos_id = self._sp.eos_id()

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    if not os.path.exists(path):
      raise FileNotFoundError(f"Tokenizer file {path!r} does not exist.")
    with open(path, "rb") as f:
      return cls(f.read(), path=path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._sp.decode([i for i in ids if i not in (self.pad_id, self.bos_id)])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def save(self, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(self._sp.serialized_model_proto())
    os.replace(tmp, path)


def train_sentencepiece(texts: Iterable[str], vocab_size: int = 64) -> Tokenizer:
  """BPE with digits split into single tokens (so numbers tokenize one digit per token)."""
  model = io.BytesIO()
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
  )
  return Tokenizer(model.getvalue())
