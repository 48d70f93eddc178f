"""The safetensors format, read and written by rlx itself (never pickle, no torch needed).

A file is an 8-byte little-endian header length, a JSON header of {dtype, shape, data_offsets}
entries and raw little-endian tensor data. `_read_header` checks a header completely before
any data is read (a truncated or corrupt file is one line naming it); `_read_rows` reads a
row block of one tensor; `_find_checkpoint` finds every tensor of a model directory (single
file or shards + index); `write_safetensors` streams tensors out one at a time.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from typing import Any, Callable

import ml_dtypes
import numpy as np

from rlx.model.hf_config import _json_type, _read_json_object

# Every dtype of the safetensors format, with its item size; rlx loads the float ones.
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20


# ====================================================================== reading


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  file: str
  dtype: str  # safetensors name: "BF16", "F32", ...
  shape: tuple[int, ...]
  offset: int  # absolute byte offset in the file
  nbytes: int

  @property
  def np_dtype(self) -> np.dtype:
    return _ST_DTYPES[self.dtype]


def _no_duplicate_keys(pairs):
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"key {key!r} appears twice")
    out[key] = value
  return out


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _read_header(path: str) -> dict[str, _TensorInfo]:
  """Parses and checks a safetensors header; reads no tensor data.

  Checks what the format requires: a JSON object of {dtype, shape, data_offsets} entries
  whose byte ranges, sorted by start, tile the data section exactly (no gap, no overlap,
  nothing past the end), each holding prod(shape) * itemsize bytes.
  """
  header, n, size = _header_json(path)
  spans = sorted((*_tensor_span(name, meta, path), name) for name, meta in header.items())
  _check_tiling(spans, path, n, size)
  return {name: _TensorInfo(path, header[name]["dtype"], tuple(header[name]["shape"]),
                            8 + n + begin, end - begin) for begin, end, name in spans}


def _header_json(path: str) -> tuple[dict[str, Any], int, int]:
  """(the header's tensor entries, without __metadata__; the header's length; the file's)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise ValueError(f"Checkpoint file {path} is truncated ({size} bytes): no safetensors header.")
    n = int.from_bytes(raw, "little")
    if n > min(size - 8, _MAX_HEADER_BYTES):
      raise ValueError(f"Checkpoint file {path} is truncated or not a safetensors file: header "
                       f"length {n} does not fit in the file's {size} bytes.")
    raw = f.read(n)
  bad = f"Checkpoint file {path} has a corrupt safetensors header"
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
  except UnicodeDecodeError as e:
    raise ValueError(f"{bad}: it is not UTF-8 (byte {e.start}: {e.reason}).") from e
  except json.JSONDecodeError as e:
    raise ValueError(f"{bad}: not valid JSON (line {e.lineno} column {e.colno}: "
                     f"{e.msg}).") from e
  except ValueError as e:  # a duplicate key
    raise ValueError(f"{bad}: {e}.") from e
  if not isinstance(header, dict):
    raise ValueError(f"{bad}: it is a JSON {_json_type(header)}, expected an object.")
  metadata = header.pop("__metadata__", None)
  if metadata is not None and not isinstance(metadata, dict):
    raise ValueError(f"{bad}: __metadata__ is a JSON {_json_type(metadata)}, expected an "
                     "object.")
  return header, n, size


def _tensor_span(name: str, meta: Any, path: str) -> tuple[int, int]:
  """A header entry's data_offsets (begin, end), once dtype, shape and size are checked."""
  where = f"Tensor {name!r} in {path}"
  if not isinstance(meta, dict):
    raise ValueError(f"{where} is described by a JSON {_json_type(meta)}, expected an object "
                     "with dtype, shape and data_offsets.")
  for key in ("dtype", "shape", "data_offsets"):
    if key not in meta:
      raise ValueError(f"{where} has no {key!r} in the safetensors header.")
  dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
  if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
    raise ValueError(f"{where} has dtype {dtype!r}; safetensors dtypes are "
                     f"{sorted(_ST_ITEMSIZE)}.")
  if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
    raise ValueError(f"{where} has shape {shape!r}, expected a list of non-negative "
                     "integers.")
  if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
      or offsets[0] < 0 or offsets[1] < offsets[0]):
    raise ValueError(f"{where} has data_offsets {offsets!r}, expected [begin, end] with "
                     "0 <= begin <= end.")
  begin, end = offsets
  nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
  if end - begin != nbytes:
    raise ValueError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but "
                     f"{dtype}{shape} needs {nbytes}.")
  return begin, end


def _check_tiling(spans: list[tuple[int, int, str]], path: str, n: int, size: int) -> None:
  """The (begin, end, name) spans, sorted, must tile the data section after the n-byte
  header of a size-byte file exactly."""
  data_size = size - 8 - n
  last = max(spans, key=lambda s: s[1], default=(0, 0, None))
  if last[1] > data_size:
    raise ValueError(f"Checkpoint file {path} is truncated: its header describes "
                     f"{8 + n + last[1]} bytes of data, but the file has {size} (tensor "
                     f"{last[2]!r} has data_offsets [{last[0]}, {last[1]}], past the "
                     f"{data_size}-byte data section).")
  expected, prev = 0, None
  for begin, end, name in spans:
    if begin != expected:
      what = (f"overlap tensor {prev[2]!r} at [{prev[0]}, {prev[1]}]" if begin < expected else
              f"leave a gap of {begin - expected} bytes after "
              + (f"tensor {prev[2]!r}" if prev else "the header"))
      raise ValueError(f"Tensor {name!r} in {path}: data_offsets [{begin}, {end}] {what}; "
                       "expected the tensors to tile the data section with no gap or overlap.")
    expected, prev = end, (begin, end, name)
  if expected != data_size:
    raise ValueError(f"Checkpoint file {path} has {data_size - expected} bytes after its last "
                     "tensor; expected the tensors to fill the data section exactly.")


def _read_rows(f, info: _TensorInfo, start: int, stop: int) -> np.ndarray:
  """Rows [start, stop) of the tensor's leading axis, as a fresh array in the file's dtype."""
  row_elems = math.prod(info.shape[1:])
  buf = np.empty((stop - start) * row_elems * info.np_dtype.itemsize, np.uint8)
  f.seek(info.offset + start * row_elems * info.np_dtype.itemsize)
  if f.readinto(buf) != buf.size:
    raise ValueError(f"Checkpoint file {info.file} is truncated.")
  return buf.view(info.np_dtype).reshape((stop - start,) + info.shape[1:])


def _find_checkpoint(path: str) -> dict[str, _TensorInfo]:
  """All tensors of a checkpoint directory: name -> where to read it."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist.")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path!r} is a file; load_hf expects a Hugging Face model directory "
                            "(config.json + *.safetensors).")
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has weight_map={weight_map!r}, expected an object of tensor "
                       "name -> file name.")
    tensors: dict[str, _TensorInfo] = {}
    headers: dict[str, dict[str, _TensorInfo]] = {}
    for name, file in weight_map.items():
      if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"{index} maps tensor {name!r} to {file!r}, expected a file name in "
                         f"{path}.")
      if file not in headers:
        fpath = os.path.join(path, file)
        if not os.path.exists(fpath):
          raise FileNotFoundError(f"Shard {file!r} listed in {index} does not exist.")
        headers[file] = _read_header(fpath)
      if name not in headers[file]:
        raise ValueError(f"Tensor {name!r} is listed in {index} under {file!r}, but that file "
                         "does not contain it.")
      tensors[name] = headers[file][name]
    return tensors
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if os.path.exists(single):
    return _read_header(single)
  if len(files) == 1:
    return _read_header(files[0])
  if files:
    raise ValueError(f"{path} holds {len(files)} safetensors files but no "
                     "model.safetensors.index.json saying which tensor lives where.")
  pickles = [os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin"))
             + glob.glob(os.path.join(path, "*.pt")) + glob.glob(os.path.join(path, "*.pth"))]
  if pickles:
    raise ValueError(
        f"{path} has only PyTorch pickle weights ({sorted(pickles)}); rlx reads safetensors only "
        "and never unpickles. Convert once with transformers: AutoModelForCausalLM."
        "from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True).")
  raise FileNotFoundError(f"{path} has no model.safetensors (or sharded *.safetensors with "
                          "model.safetensors.index.json).")


# ====================================================================== writing


def write_safetensors(out_dir: str, tensors: list[tuple[str, tuple[int, ...]]],
                      fetch: Callable[[str], np.ndarray], *, dtype: np.dtype,
                      max_shard_bytes: int = 5 * 10**9, write: bool = True,
                      name: str = "model") -> int:
  """Streams tensors into model.safetensors (or shards + index), one tensor on the host at a time.

  tensors: (name, shape) in file order; fetch(name) returns the array (any float dtype; cast
  to dtype here). Returns the bytes of tensor data written. With write=False only fetch is
  called (multi-process runs, where every process must join the gathers). name: the files'
  stem ("adapter_model" for a PEFT adapter); "model" replaces every *.safetensors in out_dir,
  another stem only its own files.
  """
  stem = name
  dtype = np.dtype(dtype)
  shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
  size = 0
  for name, shape in tensors:
    nbytes = math.prod(shape) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, tuple(shape)))
    size += nbytes
  if write:
    os.makedirs(out_dir, exist_ok=True)
    pattern = "*.safetensors" if stem == "model" else f"{glob.escape(stem)}*.safetensors"
    for stale in glob.glob(os.path.join(out_dir, pattern)) + glob.glob(
        os.path.join(out_dir, f"{glob.escape(stem)}.safetensors.index.json")):
      os.remove(stale)
  n = len(shards)
  weight_map = {}
  total = 0
  for i, shard in enumerate(shards):
    fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
      nbytes = math.prod(shape) * dtype.itemsize
      header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
      weight_map[name] = fname
    total += offset
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = os.path.join(out_dir, fname + ".tmp")
    f = open(tmp, "wb") if write else None
    try:
      if f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
      for name, shape in shard:
        host = np.asarray(fetch(name))
        if tuple(host.shape) != shape:
          raise ValueError(f"Tensor {name!r} has shape {list(host.shape)}, expected {list(shape)}.")
        if f:
          data = np.ascontiguousarray(host.astype(dtype, copy=False)).reshape(-1)
          f.write(memoryview(data.view(np.uint8)))  # no bytes copy of the tensor
        del host
    finally:
      if f:
        f.close()
    if write:
      os.replace(tmp, os.path.join(out_dir, fname))
  if write and n > 1:
    with open(os.path.join(out_dir, f"{stem}.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                sort_keys=True)
  return total
