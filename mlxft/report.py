"""Progress reporting: a live status line on a terminal, one line per report otherwise,
and every report appended to ``metrics.jsonl`` in the run directory."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

from mlxft.checkpoint import append_metrics


class Reporter:
    def __init__(self, run_dir: Path, total_steps: int, stream=None, enabled: bool = True):
        self.enabled = enabled  # False on data-parallel ranks other than 0
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout or open(os.devnull, "w")  # sys.stdout is None when fd 1 is closed
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        # Called once when the stream stops taking lines (the reader of a pipe went away, the
        # terminal hung up): the trainer stops with a checkpoint rather than train unwatched.
        self.on_stream_lost: Callable[[BaseException], None] | None = None
        self.stream_lost = False
        self._window_start = time.perf_counter()
        self._loss_sum = 0.0
        self._loss_tokens = 0  # the loss's denominator; may hold steps from before a resume
        self._tokens = 0  # throughput's, since the window's clock started
        self._real_tokens = 0
        self.unlogged_steps = 0  # accounted since the last training record
        self.last_train_loss: float | None = None

    def _print(self, line: str) -> None:
        if self.enabled:
            self._write(("\r\033[K" if self.live else "") + line + "\n")

    def _write(self, text: str) -> None:
        if self.stream_lost:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError) as err:  # EPIPE (`| head`), EIO (a hung-up terminal), a closed file
            self._lose_stream(err)

    def _lose_stream(self, err: BaseException) -> None:
        self.stream_lost = True
        if self.stream is sys.stdout:
            try:  # later prints and the exit's flush then go nowhere instead of raising again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        if self.on_stream_lost is not None:
            self.on_stream_lost(err)

    def info(self, line: str) -> None:
        self._print(line)

    def step(self, step: int, loss_sum: float, tokens: int, real_tokens: int) -> None:
        """Account one optimizer step; on a terminal, redraw the status line."""
        self._loss_sum += loss_sum
        self._loss_tokens += tokens
        self._tokens += tokens
        self._real_tokens += real_tokens
        self.unlogged_steps += 1
        if self.live and self.enabled:
            self._write(f"\r\033[K[{step}/{self.total_steps}] {self._bar(step)} loss {_shown(self._window_loss())}")

    def _window_loss(self) -> float | None:
        """The token-weighted loss since the last report; None when no token was supervised
        (a step whose rows held none), which a 0.0 would pass off as a perfect fit."""
        return self._loss_sum / self._loss_tokens if self._loss_tokens else None

    def _bar(self, step: int, width: int = 24) -> str:
        done = int(width * step / max(self.total_steps, 1))
        return "#" * done + "." * (width - done)

    def train(self, step: int, epoch: int, learning_rate: float, skipped: int, ended_at: float | None = None) -> dict:
        """Report the loss and throughput since the previous report, then reset the window.
        ``ended_at``: where the window ends and the next begins (``time.perf_counter()``) when
        that is earlier than now: the moment the next step began to be queued."""
        end = ended_at or time.perf_counter()
        elapsed = max(end - self._window_start, 1e-9)
        loss = self._window_loss()
        record = {
            "type": "train",
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "learning_rate": learning_rate,
            "seconds": elapsed,  # the window's training time: with the rates, what it trained
            "supervised_tokens_per_sec": self._tokens / elapsed,
            "tokens_per_sec": self._real_tokens / elapsed,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "skipped_steps": skipped,
        }
        self._print(
            f"step {step}/{self.total_steps} | epoch {epoch} | loss {_shown(loss)} | lr {learning_rate:.2e} | "
            f"{record['tokens_per_sec']:.0f} tok/s ({record['supervised_tokens_per_sec']:.0f} supervised) | "
            f"peak {record['peak_memory_gb']:.2f} GB"
            + (f" | skipped {skipped}" if skipped else "")
        )
        self._record(record)
        if loss is not None:
            self.last_train_loss = loss
        self._loss_sum, self._loss_tokens, self._tokens, self._real_tokens, self.unlogged_steps = 0.0, 0, 0, 0, 0
        self._window_start = end
        return record

    def eval(self, step: int, loss: float, tokens: int) -> dict:
        from mlxft.loss import perplexity

        record = {"type": "eval", "step": step, "val_loss": loss, "val_ppl": perplexity(loss), "val_tokens": tokens}
        self._print(f"step {step}/{self.total_steps} | val loss {loss:.4f} | val ppl {record['val_ppl']:.3f}")
        self._record(record)
        return record

    def exact_match(self, step: int, score: float, rows: int, when: str, peak_memory_gb: float,
                    held_out: bool = True) -> dict:
        """``held_out``: the rows are validation rows; otherwise training rows (a run with no
        validation set), which the line says, since the run has seen their answers."""
        record = {"type": "exact_match", "step": step, "exact_match": score, "rows": rows,
                  "rows_from": "validation" if held_out else "training",
                  "peak_memory_gb": peak_memory_gb}  # generation's own
        kind = "held-out" if held_out else "training (no validation set)"
        self._print(f"exact-match {when}: {score:.1%} of {rows} {kind} rows (generation peak {peak_memory_gb:.2f} GB)")
        self._record(record)
        return record

    def unlogged(self) -> dict:
        """The loss of the steps since the last training record, for a checkpoint: a run resumed
        from it logs them in its first record, as an uninterrupted run would."""
        return {"loss_sum": self._loss_sum, "tokens": self._loss_tokens, "steps": self.unlogged_steps}

    def restore_unlogged(self, saved: dict | None) -> None:
        """Take :meth:`unlogged` back (throughput restarts: it times this process's steps only)."""
        if saved:
            self._loss_sum, self._loss_tokens, self.unlogged_steps = saved["loss_sum"], saved["tokens"], saved["steps"]

    def _record(self, record: dict) -> None:
        if self.enabled:
            append_metrics(self.run_dir, record)

    def start_clock(self) -> None:
        """Time the next logged window from now (setup, estimates and baselines are not training)."""
        self._window_start = time.perf_counter()

    def pause_clock(self, seconds: float) -> None:
        """Exclude time spent outside training (evaluation, saving) from throughput."""
        self._window_start += seconds


def _shown(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"
