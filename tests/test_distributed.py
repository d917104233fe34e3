"""Data-parallel training over MLX's ring backend on loopback, against one process."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import mlx.core as mx

from conftest import write_jsonl
from mlxft import checkpoint, distributed, generation
from mlxft.config import RunConfig
from mlxft.trainer import Trainer


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def train_args(model, data, out, *extra):
    return ["-m", "mlxft.train", "--model", model, "--data", data, "--output-dir", out, "--optimizer", "sgd",
            "--learning-rate", "0.2", "--schedule", "constant", "--max-grad-norm", "0", "--batch-size", 4,
            "--log-every", 1, *extra]


def launch(tmp_path, args, ranks=2, timeout=240, start=None, on_line=None, extra_env=None):
    """Start ``ranks`` processes as mlx.launch would for the ring backend; return their results."""
    hostfile = tmp_path / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    procs = []
    for rank in (start if start is not None else range(ranks)):
        env = {**os.environ, **(extra_env or {}), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        if on_line is not None:
            on_line(procs)
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def adapters(run_dir):
    return {k: np.array(v) for k, v in mx.load(str(run_dir / "adapters.safetensors")).items()}


@pytest.fixture(scope="module")
def uneven_data(tmp_path_factory):
    """Rows of very different supervised lengths: 13 rows, so the last global batch is short."""
    rows = [{"prompt": f"Q{i}: " + "word " * (i % 5), "completion": "answer " * (1 + (i * 7) % 11)} for i in range(13)]
    directory = tmp_path_factory.mktemp("data")
    write_jsonl(directory / "train.jsonl", rows)
    write_jsonl(directory / "valid.jsonl", rows[:5])
    return directory


def test_two_ranks_equal_one_process(llama_dir, uneven_data, tmp_path):
    single = tmp_path / "single"
    # Windows of three micro-batches, the last one short: this covers one-micro-batch steps too.
    base = ["--epochs", 2, "--grad-accum-steps", 3, "--eval-every", 2]
    proc = subprocess.run([sys.executable, *map(str, train_args(llama_dir, uneven_data, single, *base, "--backend", "none"))],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    multi = tmp_path / "multi"
    # A fresh kernel cache (MLX keeps it under TMPDIR) and a --dist-timeout shorter than building
    # it (11 s for the first micro-batch here, alone): each rank builds its kernels as local work
    # (the baseline validation, then the first micro-batch), not on the way to a sum that a peer
    # waits on with its watchdog running.
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    results = launch(tmp_path, train_args(llama_dir, uneven_data, multi, *base, "--dist-timeout", 10),
                     extra_env={"TMPDIR": str(kernels)})
    assert [r[0] for r in results] == [0, 0], [r[2][-800:] for r in results]
    assert "2 data-parallel ranks" in results[0][1] and results[1][1] == ""  # only rank 0 reports
    expected, got = adapters(single), adapters(multi)
    for name in expected:  # equal up to float32 sums taken in another order (other padded shapes)
        rel = np.linalg.norm(got[name] - expected[name]) / np.linalg.norm(expected[name])
        assert rel < 1e-4, (name, rel)
    one = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (multi / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(one, two):  # the logged losses are global
        assert a["type"] == b["type"] and a["step"] == b["step"]
        key = "loss" if a["type"] == "train" else "val_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-4)


def test_interrupted_distributed_run_resumes_exactly(llama_dir, uneven_data, tmp_path):
    full = tmp_path / "full"
    base = ["--epochs", 4, "--grad-accum-steps", 2]  # 8 steps: the signal lands well before the end
    results = launch(tmp_path, train_args(llama_dir, uneven_data, full, *base))
    assert [r[0] for r in results] == [0, 0]

    part = tmp_path / "part"

    def interrupt_rank_1(procs):
        for line in procs[0].stdout:
            if "step 2/" in line:
                procs[1].send_signal(signal.SIGTERM)  # only one rank is signalled; both must stop
                break

    results = launch(tmp_path, train_args(llama_dir, uneven_data, part, *base), on_line=interrupt_rank_1)
    assert [r[0] for r in results] == [128 + signal.SIGTERM] * 2, [r[2][-500:] for r in results]
    assert "stopped by SIGTERM" in results[0][2] and "stopped by" not in results[1][2]  # rank 0 says it for both
    emergency = (part / "latest").resolve()
    assert emergency.name.endswith("-emergency")
    # Killed while saving it again, between the swap's two renames: latest names a hidden copy
    # and the checkpoint itself is hidden. No rank may read latest before rank 0 has put it right.
    checkpoint._hold_latest(part, emergency)
    aside = Path(tempfile.mkdtemp(prefix=f".{emergency.name}.", suffix=".old", dir=part))
    os.replace(emergency, aside / emergency.name)
    results = launch(tmp_path, train_args(llama_dir, uneven_data, part, *base, "--resume", "latest"))
    assert [r[0] for r in results] == [0, 0], [r[2][-500:] for r in results]
    expected, got = adapters(full), adapters(part)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_save_request_to_one_rank_saves_on_all_and_training_goes_on(llama_dir, uneven_data, tmp_path):
    out = tmp_path / "run"

    def request_on_rank_1(procs):
        for line in procs[0].stdout:
            if "step 1/" in line:
                procs[1].send_signal(signal.SIGUSR1)  # rank 0 holds the save and must hear of it
                break

    results = launch(tmp_path, train_args(llama_dir, uneven_data, out, "--epochs", 4, "--grad-accum-steps", 2),
                     on_line=request_on_rank_1)
    assert [r[0] for r in results] == [0, 0], [r[2][-500:] for r in results]
    assert "saving a checkpoint after the current step" in results[1][2]
    (requested,) = out.glob("checkpoint-*")
    step = json.loads((requested / "trainer_state.json").read_text())["step"]
    assert 1 <= step < 8 and not (requested / "window.safetensors").exists()


def test_a_one_process_checkpoint_inside_a_window_resumes_on_two_ranks(llama_dir, uneven_data, tmp_path):
    """Only a one-process run stops inside an accumulation window. Resumed on two ranks, each
    restored the window and the step summed both: the micro-batches before the stop counted twice."""
    from mlxft import config as cfg
    from mlxft.train import parser
    from mlxft.trainer import TrainingStopped

    def run_config(out, *extra):
        argv = [str(a) for a in train_args(llama_dir, uneven_data, out, "--grad-accum-steps", 2, *extra)[2:]]
        return cfg.resolve(parser().parse_args(argv), None)

    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(run_config(full, "--backend", "none")).train()
    stopped = Trainer(run_config(part, "--backend", "none"))
    first_micro_batch = stopped._micro_step

    def then_stop(batches):
        first_micro_batch(batches)
        stopped.stop.request(signal.SIGTERM)

    stopped._micro_step = then_stop
    with pytest.raises(TrainingStopped):
        stopped.train()
    assert (part / "checkpoint-0-emergency" / "window.safetensors").is_file()
    results = launch(tmp_path, train_args(llama_dir, uneven_data, part, "--grad-accum-steps", 2, "--resume", "latest"))
    assert [r[0] for r in results] == [0, 0], [r[2][-800:] for r in results]
    expected, got = adapters(full), adapters(part)
    for name in expected:
        rel = np.linalg.norm(got[name] - expected[name]) / np.linalg.norm(expected[name])
        assert rel < 1e-4, (name, rel)
    first, resumed = ([r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"][0]
                      for run in (full, part))
    assert resumed["step"] == first["step"] == 1 and resumed["loss"] == pytest.approx(first["loss"], rel=1e-5)
    assert resumed["tokens_per_sec"] * resumed["seconds"] == pytest.approx(first["tokens_per_sec"] * first["seconds"])


POISONED = ("import sys\nimport mlx.core as mx\nfrom mlxft import trainer\nfrom mlxft.train import main\n"
            "account = trainer.Trainer._account\n"
            "def poisoned(self, done):\n"
            "    if done.step == 2:  # read as an overflow would be\n"
            "        done.result.applied = mx.array(False)\n"
            "    return account(self, done)\n"
            "trainer.Trainer._account = poisoned\nsys.exit(main(sys.argv[1:]))\n")


def test_a_non_finite_stop_on_two_ranks_saves_the_whole_open_window(llama_dir, uneven_data, tmp_path):
    # The stop is read once the next window's first micro-batch is queued; rank 0 saved only its
    # own share of it, so the other rank's rows of that micro-batch were lost on resume.
    base = ["--epochs", 4, "--grad-accum-steps", 2, "--max-nonfinite-steps", 1, "--seed", 3]
    one, two = tmp_path / "one", tmp_path / "two"
    stopped = subprocess.run([sys.executable, "-c", POISONED, *map(str, train_args(llama_dir, uneven_data, one, *base,
                                                                              "--backend", "none")[2:])],
                             capture_output=True, text=True, timeout=240)
    assert stopped.returncode == 1 and "not finite" in stopped.stderr, stopped.stderr[-800:]
    results = launch(tmp_path, ["-c", POISONED, *train_args(llama_dir, uneven_data, two, *base)[2:]])
    assert [r[0] for r in results] == [1, 1], [r[2][-800:] for r in results]
    states = [json.loads((run / "checkpoint-2-emergency" / "trainer_state.json").read_text()) for run in (one, two)]
    assert states[0]["batch_index"] % 2 == 1 and states[0]["window_real_tokens"] == states[1]["window_real_tokens"]
    for run in (one, two):
        resumed = subprocess.run([sys.executable, *map(str, train_args(llama_dir, uneven_data, run, *base, "--backend",
                                                                       "none", "--resume", "latest"))],
                                 capture_output=True, text=True, timeout=240)
        assert resumed.returncode == 0, resumed.stderr[-800:]
    expected, got = adapters(one), adapters(two)
    for name in expected:
        rel = np.linalg.norm(got[name] - expected[name]) / np.linalg.norm(expected[name])
        assert rel < 1e-4, (name, rel)


def test_missing_peer_fails_within_the_timeout(llama_dir, uneven_data, tmp_path):
    tic = time.monotonic()
    results = launch(tmp_path, train_args(llama_dir, uneven_data, tmp_path / "run", "--dist-timeout", 4), start=[0],
                     timeout=120)
    code, _, err = results[0]
    assert code != 0 and "could not reach its peers within 4 s" in err
    assert time.monotonic() - tic < 60


def test_a_dead_rank_stops_the_other(llama_dir, uneven_data, tmp_path):
    def kill_rank_1(procs):
        for line in procs[0].stdout:
            if "step 1/" in line:
                procs[1].kill()
                break

    results = launch(tmp_path, train_args(llama_dir, uneven_data, tmp_path / "run", "--epochs", 50, "--dist-timeout", 6),
                     on_line=kill_rank_1, timeout=120)
    code, _, err = results[0]
    # Either the ring notices the closed socket, or the watchdog notices the silence.
    assert code != 0 and ("another rank failed" in err or "no progress for 6 s" in err) and "Traceback" not in err


def patched_cli(tmp_path, patch: str):
    """A script that runs ``python -m mlxft.train`` after ``patch`` (Python source) has run."""
    script = tmp_path / f"patched-{time.monotonic_ns()}.py"
    script.write_text("import os, sys, time\nfrom mlxft import checkpoint, distributed\nfrom mlxft.train import main\n"
                      + patch + "sys.exit(main())\n")
    return script


def slowed_writes(seconds: float, only: str = "") -> str:
    """Patch source for :func:`patched_cli`: each safetensors file whose path contains ``only``
    takes ``seconds`` longer to write."""
    return ("write = checkpoint.save_safetensors\n"
            "def slow(path, *args, **kwargs):\n"
            f"    if {only!r} in str(path):\n"
            f"        time.sleep({seconds})\n"
            "    return write(path, *args, **kwargs)\n"
            "checkpoint.save_safetensors = slow\n")


def timeout_from_the_first_save(seconds: float) -> str:
    """Patch source for :func:`patched_cli`: the run starts with a generous --dist-timeout and
    each rank's watchdog tightens to ``seconds`` when the first save begins, so what a test of
    saving times is the save, not how long the first step's kernels take to compile here."""
    return ("wait = distributed.World.main_rank_work\n"
            "def tightened(self, work):\n"
            "    if not getattr(self, 'tightened', False):\n"
            "        self._watchdog.stop()\n"
            f"        self._watchdog = distributed._Watchdog(self.rank, 'ring', {seconds})\n"
            "        self._watchdog.started()\n"
            "        self.tightened = True\n"
            "    return wait(self, work)\n"
            "distributed.World.main_rank_work = tightened\n")


def test_saves_may_outlast_the_timeout_while_each_file_fits(llama_dir, uneven_data, tmp_path):
    """Rank 0 answers the waiting ranks between the files it writes: three files of 2 s each
    make every save longer than --dist-timeout 5, and no rank may stop over it."""
    script = patched_cli(tmp_path, slowed_writes(2) + timeout_from_the_first_save(5))
    run = tmp_path / "run"
    args = train_args(llama_dir, uneven_data, run, "--max-steps", 2, "--save-every", 1, "--dist-timeout", 120)[2:]
    results = launch(tmp_path, [script, *args], timeout=180)
    assert [r[0] for r in results] == [0, 0], [r[2][-500:] for r in results]
    assert (run / "checkpoint-1").is_dir() and (run / "latest").resolve() == (run / "final")


def test_a_rank_lost_during_a_save_leaves_the_checkpoint_written(llama_dir, uneven_data, tmp_path):
    """Rank 1 leaves as rank 0 starts its first save: rank 0 finishes writing alone, then exits
    with the lost peer's error."""
    script = patched_cli(tmp_path, "if os.environ['MLX_RANK'] == '1':\n"
                                   "    distributed.World.main_rank_work = lambda self, work: os._exit(9)\n")
    run = tmp_path / "run"
    args = train_args(llama_dir, uneven_data, run, "--max-steps", 3, "--save-every", 1, "--dist-timeout", 30)[2:]
    (code, _, err), (left, _, _) = launch(tmp_path, [script, *args], timeout=180)
    assert left == 9 and code == 3, err[-800:]
    assert "another rank failed" in err and "Traceback" not in err
    saved = checkpoint.load_checkpoint(run / "checkpoint-1")
    assert saved["state"]["step"] == 1 and (run / "latest").resolve() == run / "checkpoint-1"


def test_a_file_longer_than_the_timeout_is_still_written(llama_dir, uneven_data, tmp_path):
    """One checkpoint file takes 8 s against --dist-timeout 4: the waiting rank gives up, and
    rank 0 still finishes that checkpoint (its own clock runs only while it waits on a peer)."""
    script = patched_cli(tmp_path, slowed_writes(8, only="optimizer") + timeout_from_the_first_save(4))
    run = tmp_path / "run"
    args = train_args(llama_dir, uneven_data, run, "--max-steps", 3, "--save-every", 1, "--dist-timeout", 120)[2:]
    (code, _, err), (waited, _, waited_err) = launch(tmp_path, [script, *args], timeout=180)
    assert waited != 0 and "no progress for 4 s" in waited_err, waited_err[-500:]
    assert code != 0 and "no progress" not in err, err[-500:]  # rank 0 stopped over the lost peer, not its watchdog
    saved = checkpoint.load_checkpoint(run / "checkpoint-1")
    assert saved["state"]["step"] == 1 and (run / "latest").resolve() == run / "checkpoint-1"


def test_watchdog_pauses_for_local_work_only():
    """Generating, loading or saving (local work) may outlast --dist-timeout; silence after it may not."""
    victim = subprocess.Popen(["sleep", "30"])  # stands in for the rank the watchdog guards
    world = distributed.World()
    world._watchdog = distributed._Watchdog(0, "ring", 0.5, parent=victim.pid)
    try:
        world._watchdog.started()
        with world.local_work():
            with world.local_work():  # nested: its end must not restart the clock yet
                pass
            time.sleep(1.2)
        assert victim.poll() is None
        assert victim.wait(timeout=10) == -signal.SIGKILL  # no heartbeat after the local work
    finally:
        victim.kill()
        world.close()


def _wait_until_ignored(pid: int, sig: int, timeout: float = 30.0) -> None:
    status = Path(f"/proc/{pid}/status")
    if not status.exists():  # not Linux: time for the interpreter to start
        time.sleep(2)
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        ignored = next(line for line in status.read_text().splitlines() if line.startswith("SigIgn:"))
        if int(ignored.split()[1], 16) >> (sig - 1) & 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never ignored signal {sig}")


def test_watchdog_outlives_the_signals_that_stop_its_rank():
    """Ctrl-C reaches the watchdog too (one process group): it used to die with a traceback,
    leaving the rank's emergency stop unguarded. It ends when the rank closes its pipe."""
    victim = subprocess.Popen(["sleep", "30"])
    watchdog = distributed._Watchdog(0, "ring", 60, parent=victim.pid)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # nohup ignores SIGHUP from the start
            _wait_until_ignored(watchdog._proc.pid, sig)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            watchdog._proc.send_signal(sig)
        time.sleep(0.5)
        assert watchdog._proc.poll() is None
        watchdog.stop()
        assert watchdog._proc.returncode == 0 and victim.poll() is None
    finally:
        victim.kill()
        if watchdog._proc.poll() is None:
            watchdog._proc.kill()


def test_pause_and_resume_wait_on_a_full_pipe_and_beats_do_not():
    """A dropped pause lets the watchdog kill a rank in long local work; a dropped resume turns
    it off. A beat may be dropped: a full pipe wakes the watchdog anyway."""
    victim = subprocess.Popen(["sleep", "30"])
    watchdog = distributed._Watchdog(0, "ring", 60, parent=victim.pid)
    try:
        for send, blocking in ((watchdog.pause, True), (watchdog.beat, False), (watchdog.resume, True)):
            send()
            assert os.get_blocking(watchdog._write) is blocking, send.__name__
    finally:
        watchdog.stop()
        victim.kill()


def test_reading_the_data_files_counts_as_local_work(uneven_data, monkeypatch):
    """Checking a large JSONL file takes as long as it takes on each rank (4.9 s for 82 MB)."""
    from mlxft import data

    world = distributed.World()
    depth = []

    def check_file(path):
        depth.append(world._local_depth)
        if len(depth) == 2:
            raise RuntimeError("checked both")

    monkeypatch.setattr(data, "check_file", check_file)
    config = RunConfig.from_dict({"model": {"model": "unused"}, "data": {"data": str(uneven_data)},
                                  "train": {"output_dir": str(uneven_data / "unused")}})
    with pytest.raises(RuntimeError, match="checked both"):
        Trainer(config, world=world)
    assert depth == [1, 1] and world._local_depth == 0


def test_each_rank_draws_its_own_dropout_and_only_rank_0_warns(llama_dir, tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace as Ranks

    from mlxft import data
    from mlxft.trainer import dropout_seed

    one = distributed.World()
    # One process: as before ranks existed, so its checkpoints resume with the same noise.
    assert dropout_seed(3, 1, 5, one) == int(np.random.SeedSequence([3, 1, 5]).generate_state(1)[0])
    seeds = {dropout_seed(3, 1, 5, Ranks(rank=r, size=2)) for r in (0, 1)}
    assert len(seeds) == 2 and dropout_seed(3, 1, 6, Ranks(rank=0, size=2)) not in seeds

    rows = [{"prompt": "q", "completion": "a " * 40}, {"prompt": "q", "completion": "a"}]  # one too long
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    warned = []
    load = data.load_dataset
    monkeypatch.setattr(data, "load_dataset", lambda *args, **kwargs: warned.append(kwargs["warn"]) or load(*args, **kwargs))
    second = distributed.World()
    second.rank = 1  # the other rank of a two-rank run, as far as the trainer's data loading goes
    config = RunConfig.from_dict({"model": {"model": str(llama_dir)}, "data": {"data": str(tmp_path / "data"),
                                  "max_seq_length": 24}, "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1}})
    Trainer(config, world=second)
    assert warned == [False] and "warning" not in capsys.readouterr().err
    Trainer(config, world=one)
    assert "1 of 2 rows were longer than max_seq_length=24 and were truncated" in capsys.readouterr().err


def test_exact_match_generation_counts_as_local_work(uneven_data, monkeypatch):
    world = distributed.World()
    depth = []
    monkeypatch.setattr(generation, "exact_match", lambda *args: depth.append(world._local_depth) or (1.0, []))
    config = RunConfig()
    config.train.exact_match_rows = 2
    trainer = SimpleNamespace(world=world, valid_file=uneven_data / "valid.jsonl", config=config, model=None,
                              tokenizer=None, step_count=0, reporter=SimpleNamespace(exact_match=lambda *args, **kwargs: None),
                              memory_limit=mx.get_memory_limit(), warned_generation_over_limit=False)
    Trainer._exact_match(trainer, "before training")
    assert depth == [1] and world._local_depth == 0


def test_the_memory_estimate_counts_as_local_work(monkeypatch):
    """The estimate's probes compile and run steps on each rank alone: on a slow machine they
    may outlast --dist-timeout, which only waiting on a peer may not."""
    from mlxft import memory
    from mlxft.data import Example

    world = distributed.World()
    depth = []
    estimated = memory.Estimate(weights=1, training_state=0, activations=0, loss=0)
    monkeypatch.setattr(memory, "estimate", lambda *args: depth.append(world._local_depth) or estimated)
    rows = [Example(np.arange(12, dtype=np.int32), np.arange(12) > 5) for _ in range(4)]
    trainer = SimpleNamespace(world=world, config=RunConfig(), train_set=SimpleNamespace(examples=rows), model=None,
                              optimizer=SimpleNamespace(state={}))
    trainer._largest_micro_batch = lambda: Trainer._largest_micro_batch(trainer)
    trainer._rows = lambda dataset: Trainer._rows(trainer, dataset)
    assert Trainer.estimate_memory(trainer) is estimated
    assert depth == [1] and world._local_depth == 0


def test_validation_counts_as_local_work_up_to_its_sum(monkeypatch):
    """Each rank scores its own share of every batch (the first builds the loss's kernels, for
    as long as that takes); only the final sum waits on a peer."""
    from mlxft import trainer as trainer_module
    from mlxft.data import Dataset, Example

    world = distributed.World()
    depth = []
    monkeypatch.setattr(trainer_module, "evaluation_loss",
                        lambda *args, **kwargs: depth.append(world._local_depth) or (mx.array(1.0), mx.array(3.0)))
    monkeypatch.setattr(world, "all_sum", lambda tree: depth.append(("sum", world._local_depth)) or tree)
    rows = [Example(np.arange(12, dtype=np.int32), np.arange(12) > 5) for _ in range(6)]
    config = RunConfig()
    config.train.batch_size = 2
    model = SimpleNamespace(eval=lambda: None, train=lambda mode=True: None, training=True)
    trainer = SimpleNamespace(world=world, config=config, model=model, valid_set=Dataset(None, rows, "completion"))
    trainer.batch = lambda dataset, indices: Trainer.batch(trainer, dataset, indices)
    trainer._rows = lambda dataset: Trainer._rows(trainer, dataset)
    assert Trainer.evaluate(trainer) == (1.0, 9)
    assert depth == [1, 1, 1, ("sum", 0)]
