"""The TensorFlow-free event writer: its files read back (by us and, if installed, by
TensorBoard's own EventAccumulator) with the steps and values written."""

import errno
import os

import numpy as np
import pytest

from rlx import tensorboard as tb

STEPS = {
    1: {"reward/mean": 0.25, "ledger/tokens_generated": 161.0, "time/generate_s": 4.5},
    2: {"reward/mean": np.float32(0.5), "ledger/tokens_generated": np.int64(170),
        "note": "not a number", "hist": np.zeros(3)},
    3: {"reward/mean": 0.75, "eval/band_accuracy": 0.4375, "ledger/tokens_generated": 158},
}


def write_run(logdir, steps, **kw):
  with tb.SummaryWriter(logdir, **kw) as w:
    for step, values in steps.items():
      w.scalars(step, values)
  return w.path


def test_crc32c_known_values():
  assert tb.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
  assert tb.crc32c(b"") == 0
  assert tb.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4 test vector


def test_written_scalars_read_back(tmp_path):
  path = write_run(str(tmp_path), STEPS)
  assert os.path.basename(path).startswith("events.out.tfevents.")
  records = [tb.decode_event(r) for r in tb.read_records(path)]
  assert records[0]["file_version"] == "brain.Event:2"
  got = tb.read_scalars(str(tmp_path))
  assert got["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
  assert got["ledger/tokens_generated"] == [(1, 161.0), (2, 170.0), (3, 158.0)]
  assert got["eval/band_accuracy"] == [(3, 0.4375)]
  assert "note" not in got and "hist" not in got  # non-scalars are skipped


def test_a_corrupt_record_is_detected(tmp_path):
  path = write_run(str(tmp_path), STEPS)
  data = bytearray(open(path, "rb").read())
  data[-10] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="corrupt record data"):
    list(tb.read_records(path))


def test_resume_purges_the_steps_written_again(tmp_path):
  write_run(str(tmp_path), {s: {"x": float(s)} for s in range(1, 6)})
  write_run(str(tmp_path), {s: {"x": 10.0 * s} for s in range(3, 5)}, purge_step=3)
  assert tb.read_scalars(str(tmp_path))["x"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_resumed_runs_file_sorts_after_the_earlier_ones(tmp_path, monkeypatch):
  # Regression: CI ran this file in an xdist worker whose writer counter had reached 9, so the
  # resumed file (".10") sorted before the first (".9") and the purge was replayed first.
  monkeypatch.setattr(tb.SummaryWriter, "_counter", 8)
  write_run(str(tmp_path), {s: {"x": float(s)} for s in range(1, 6)})
  write_run(str(tmp_path), {s: {"x": 10.0 * s} for s in range(3, 5)}, purge_step=3)
  assert tb.read_scalars(str(tmp_path))["x"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
  # An earlier file named from a clock ahead of ours (another host, a clock step back) still
  # sorts before the file written now.
  future = os.path.join(str(tmp_path), "events.out.tfevents.9999999999999999.elsewhere.1.000001")
  open(future, "wb").close()
  path = write_run(str(tmp_path), {6: {"x": 6.0}}, purge_step=6)
  assert sorted(os.listdir(str(tmp_path)))[-1] == os.path.basename(path)


def test_tensorboard_reads_our_files(tmp_path):
  event_accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  write_run(str(tmp_path), STEPS)
  acc = event_accumulator.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert set(acc.Tags()["scalars"]) == {"reward/mean", "ledger/tokens_generated",
                                        "time/generate_s", "eval/band_accuracy"}
  assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
      (1, 0.25), (2, 0.5), (3, 0.75)]
  assert [e.step for e in acc.Scalars("eval/band_accuracy")] == [3]


def test_tensorboard_honours_the_purge_on_resume(tmp_path):
  event_accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  write_run(str(tmp_path), {s: {"x": float(s)} for s in range(1, 6)})
  write_run(str(tmp_path), {s: {"x": 10.0 * s} for s in range(3, 5)}, purge_step=3)
  acc = event_accumulator.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                           (4, 40.0)]


class _FullDisk:
  """A file whose writes fail as on a full disk."""

  def write(self, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  flush = close = lambda self: self.write(b"")


def test_nothing_is_written_until_the_first_scalars(tmp_path):
  # A run that stops before its first metrics (a rejected config, a damaged workdir) left an
  # events file holding only the header.
  logdir = tmp_path / "tb"
  with tb.SummaryWriter(str(logdir), purge_step=3) as w:
    w.flush()
  assert w.path is None and not logdir.exists()
  w = tb.SummaryWriter(str(logdir), purge_step=3)
  w.scalars(4, {"x": 1.0})
  w.close()
  assert os.listdir(logdir) == [os.path.basename(w.path)]
  assert [tb.decode_event(r).get("session_start") for r in tb.read_records(w.path)] == [
      None, True, None]  # the header, the purge at step 3, then the scalars
  with pytest.raises(ValueError, match="is closed"):
    w.scalars(5, {"x": 2.0})


@pytest.mark.parametrize("when", ["scalars", "flush", "close"])
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, when):
  from rlx.metrics import WriteError
  w = tb.SummaryWriter(str(tmp_path), flush_every_s=3600)
  w.scalars(1, {"x": 1.0})
  w._f.close()
  w._f = _FullDisk()
  with pytest.raises(WriteError) as info:
    {"scalars": lambda: w.scalars(2, {"x": 2.0}), "flush": w.flush, "close": w.close}[when]()
  assert str(info.value) == (
      f"could not write {w.path} (No space left on device [Errno 28]); the last checkpoint is "
      f"kept: free space, then rerun the same command to resume from it.")
  assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
