"""torchtitan's own Trainer with DMuon, as its users run it (issue 62): `python -m torchtitan.train --module
titan_trainer_config --config ...` (examples/titan_trainer_config.py as it is: torchtitan's Llama3 debug config,
6 layers, with DMuon) on the CPU (its _cpu functions: dmuon.torch.titan_cpu.on_cpu), the assets
examples/titan_assets.py makes (its tokenizer; documents of SEQ - 1 words, each one row of SEQ tokens), float32
FSDP2 parameters (the one process has no FSDP2 to cast for).

Each job is launched by run_ranks.py (the ranks forked, a hard timeout):
  seed          1 rank, --checkpoint.create_seed_checkpoint: the weights every job starts from
                (--checkpoint.initial_load_path; torchtitan initialises each layout's weights differently)
  one process   1 rank, llama3_dmuon_cpu, both data-parallel ranks' rows a step: the reference
  then for each layout (2 ranks: FSDP 2; 4 ranks: TP 2 x FSDP 2) and mode (llama3_dmuon_cpu: all-to-all, torchtitan's
  Trainer; llama3_dmuon_owner_held_cpu: owner-held, dmuon.torch.titan_trainer.DMuonTrainer):
    first       STEPS steps, the Trainer's CheckpointManager saving every SAVED_AT steps
    resumed     a new job from the checkpoint of step SAVED_AT (--checkpoint.load_step): the steps after it
Both layouts have 2 data-parallel ranks; each rank's dataset shard (torchtitan takes a contiguous half of the
documents) holds, step by step, the rows the one process's dataset holds for that step.
Checks: every step's loss and gradient norm (the Trainer's own, read from its TensorBoard events) in both jobs,
and the resumed job's final weights (its last checkpoint), equal the one process's within
framework_runs.TOLERANCE. Before the jobs, in this process: owner_held under torchtitan's Trainer itself (not
DMuonTrainer) refused when the Trainer is built, by name (its train_step's clipping cannot read held gradients).

Needs torchtitan's Trainer packages (python/requirements-titan-trainer.txt; `make titan-trainer-packages` puts them
in build/titan_trainer_packages, which ctest puts on PYTHONPATH).

Run: python tests/python/torch_titan_trainer_test.py OUT
"""

import dataclasses
import glob
import os
import pathlib
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent / "examples")]

STEPS, SAVED_AT = 4, 2
DP, PER_RANK, SEQ = 2, 2, 32  # data-parallel ranks, rows a rank a step, tokens a row
LAUNCH_TIMEOUT_S = 240
LAYOUTS = (("fsdp2", 2, []), ("tp2-fsdp2", 4, ["--parallelism.tensor_parallel_degree", "2"]))
MODES = (("all-to-all", "llama3_dmuon_cpu"), ("owner-held", "llama3_dmuon_owner_held_cpu"))


def packages_or_exit():
    """Exits 1 naming what to run where the Trainer's packages are missing."""
    missing = []
    for module in ("torchdata", "datasets", "tensorboard"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        sys.exit(f"torch_titan_trainer_test: {', '.join(missing)} not importable: torchtitan's Trainer needs "
                 "python/requirements-titan-trainer.txt (`make titan-trainer-packages` installs it in "
                 "build/titan_trainer_packages, on this test's PYTHONPATH)")


def make_assets(out):
    """out/tokenizer; out/data-ranks, the data-parallel ranks' dataset, and out/data-one, the one process's: the
    same rows each step. {name: folder}."""
    import titan_assets

    titan_assets.write_tokenizer(out / "tokenizer")
    docs = titan_assets.documents(STEPS * DP * PER_RANK, SEQ - 1, seed=0)
    row = {(s, r, i): docs[(s * DP + r) * PER_RANK + i] for s in range(STEPS) for r in range(DP) for i in range(PER_RANK)}
    order = sorted(row)  # one process: step by step, each step the ranks' rows
    by_rank = sorted(row, key=lambda k: (k[1], k[0], k[2]))  # rank r's contiguous half: its rows step by step
    titan_assets.write_dataset(out / "data-one", [row[k] for k in order])
    titan_assets.write_dataset(out / "data-ranks", [row[k] for k in by_rank])
    return {"tokenizer": out / "tokenizer", "one": out / "data-one", "ranks": out / "data-ranks"}


def launch(out, label, nproc, config, args):
    """`python -m torchtitan.train --module titan_trainer_config --config CONFIG ARGS` on nproc ranks, its output in
    out/label.log; seconds it took. Exits 1 (its log's tail printed) if it fails."""
    command = [sys.executable, str(HERE / "run_ranks.py"), "--nproc", str(nproc), "--timeout", str(LAUNCH_TIMEOUT_S),
               "--", "-m", "torchtitan.train", "--module", "titan_trainer_config", "--config", config, *args]
    start = time.monotonic()
    with open(out / f"{label}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=out).returncode
    took = time.monotonic() - start
    if code != 0:
        print((out / f"{label}.log").read_text()[-12000:])
        sys.exit(f"torch_titan_trainer_test: {label} failed (exit {code}) after {took:.0f} s: "
                 f"{' '.join(command[1:])}")
    print(f"{label}: {nproc} ranks, {took:.0f} s", flush=True)
    return took


def common_args(assets, dump, data, batch):
    return ["--hf_assets_path", str(assets["tokenizer"]), "--dataloader.dataset_path", str(data),
            "--training.steps", str(STEPS), "--training.seq_len", str(SEQ), "--training.local_batch_size", str(batch),
            "--training.mixed_precision_param", "float32", "--dump_folder", str(dump),
            "--metrics.enable_tensorboard", "--metrics.disable_color_printing"]


def checkpointing(folder, seed=None, load_step=None):
    # full checkpoints (llama3_debugmodel's last_save_model_only=False: the last step's too)
    args = ["--checkpoint.enable", "--checkpoint.folder", str(folder), "--checkpoint.interval", str(SAVED_AT)]
    if seed is not None:
        args += ["--checkpoint.initial_load_path", str(seed)]
    if load_step is not None:
        args += ["--checkpoint.load_step", str(load_step)]
    return args


def logged(dump):
    """{step: (loss, gradient norm)} of a job, read from its TensorBoard events (rank 0's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(str(dump / "tb" / "*"))
    if len(runs) != 1:
        sys.exit(f"torch_titan_trainer_test: {dump}/tb holds {runs}, not one run's events")
    events = EventAccumulator(runs[0])
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("loss_metrics/global_avg_loss")}
    norm = {e.step: e.value for e in events.Scalars("grad_norm")}
    return {s: (loss[s], norm[s]) for s in sorted(loss)}


def checkpoint(folder):
    """The DCP checkpoint in `folder` as one state dict ({key: value}), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, whole)
    return torch.load(whole, weights_only=False)


def in_process(assets, out):
    """In this process (a process group of one rank), before any job: [failures], the seed checkpoint's folder and
    the step-1 gradient norm of the one process summed in float64 (torch's float32 norm of the unsharded model, the
    one-process job's, was 8.9e-5 from it, so the jobs' step-1 norms are held to this one).
      - owner_held under torchtitan's Trainer itself (not DMuonTrainer): refused as the Trainer is built, naming
        DMuonTrainer and training.max_norm;
      - the seed: the Trainer of llama3_dmuon_cpu with --checkpoint.create_seed_checkpoint, saved as
        torchtitan.train does (step 0, the model alone), on whose model the step-1 rows (the first batch of its
        dataloader) give the gradient norm."""
    import torch
    import torch.distributed as dist
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.trainer import Trainer

    import titan_trainer_config

    failures = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the Trainer then skips its own
    os.environ.setdefault("LOCAL_RANK", "0")
    config = titan_trainer_config.llama3_dmuon_owner_held_cpu()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    try:
        Trainer.Config(**{**fields, "hf_assets_path": str(assets["tokenizer"])}).build()
        failures.append("owner_held under torchtitan's Trainer was not refused")
    except ValueError as e:
        if "DMuonTrainer" not in str(e) or "training.max_norm=1.0" not in str(e):
            failures.append(f"the refusal of owner_held under torchtitan's Trainer names no remedy: {e}")

    config = titan_trainer_config.llama3_dmuon_cpu()
    config.hf_assets_path, config.dump_folder = str(assets["tokenizer"]), str(out / "seed")
    config.dataloader = dataclasses.replace(config.dataloader, dataset_path=str(assets["one"]))
    config.training = dataclasses.replace(config.training, seq_len=SEQ, local_batch_size=DP * PER_RANK, steps=STEPS)
    config.checkpoint = dataclasses.replace(config.checkpoint, enable=True, create_seed_checkpoint=True)
    trainer = config.build()
    trainer.checkpointer.save(curr_step=0, last_step=True)
    trainer.checkpointer.close()
    model = trainer.model_parts[0]
    inputs, labels = next(iter(trainer.dataloader))
    tokens = (labels != IGNORE_INDEX).sum()
    loss, _ = trainer.loss_fn(model(inputs["input"], positions=inputs["positions"]), labels, tokens,
                              positions=inputs["positions"])
    loss.backward()
    norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
    dist.destroy_process_group()
    return failures, out / "seed" / "checkpoint" / "step-0", norm


def compare(label, first, resumed, weights, reference, exact_norm):
    """Failures of a layout and mode's two jobs against the one process (the module's text): [text]."""
    from framework_runs import TOLERANCE

    ref_steps, ref_weights = reference
    failures = []
    if sorted(first) != list(range(1, STEPS + 1)) or sorted(resumed) != list(range(SAVED_AT + 1, STEPS + 1)):
        return [f"{label}: steps logged {sorted(first)} and, resumed, {sorted(resumed)}"]
    losses = {s: loss for s, (loss, _) in first.items()}
    if any(abs(losses[s] - ref_steps[s][0]) > TOLERANCE * abs(ref_steps[s][0]) for s in losses):
        failures.append(f"{label}: losses {losses}, the one process's { {s: l for s, (l, _) in ref_steps.items()} }")
    if abs(first[1][1] - exact_norm) > TOLERANCE * exact_norm:
        failures.append(f"{label}: the step-1 gradient norm {first[1][1]:.6f}, the one process's {exact_norm:.6f}")
    if any(resumed[s] != first[s] for s in resumed):  # the same steps from the saved state: bit for bit
        failures.append(f"{label}: resumed at step {SAVED_AT}, (loss, gradient norm) {resumed}; without the resume "
                        f"{ {s: first[s] for s in resumed} }")
    for k, v in ref_weights.items():
        gap = (weights[k] - v).abs().max().item() if k in weights else float("inf")
        if gap > TOLERANCE * max(1.0, v.abs().max().item()):
            failures.append(f"{label}: the resumed job's final '{k}' differs from the one process's by {gap:.3g}")
    print(f"{label}: losses {[f'{l:.6f}' for l in losses.values()]} (one process "
          f"{[f'{l:.6f}' for l, _ in ref_steps.values()]}), step-1 gradient norm {first[1][1]:.6f} (one process "
          f"{exact_norm:.6f})", flush=True)
    return failures


def main():
    out = pathlib.Path(sys.argv[1]).resolve()
    packages_or_exit()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.update(HF_HOME=str(out / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # nothing fetched
    assets = make_assets(out / "assets")
    failures, seed, exact_norm = in_process(assets, out)
    reference = out / "one-process"
    total = launch(out, "one-process", 1, "llama3_dmuon_cpu",
                    common_args(assets, reference, assets["one"], DP * PER_RANK) +
                    checkpointing(reference / "checkpoint", seed=seed))
    ref_steps = logged(reference)
    model_keys = checkpoint(seed).keys()  # the seed checkpoint holds the model alone
    ref_weights = {k: v for k, v in checkpoint(reference / "checkpoint" / f"step-{STEPS}").items() if k in model_keys}
    for layout, nproc, layout_args in LAYOUTS:
        for mode, config in MODES:
            label = f"{layout} {mode}"
            folder = out / f"{layout}-{mode}"
            total += launch(out, f"{layout}-{mode}-first", nproc, config,
                            common_args(assets, folder / "first", assets["ranks"], PER_RANK) + layout_args +
                            checkpointing(folder / "checkpoint", seed=seed))
            total += launch(out, f"{layout}-{mode}-resumed", nproc, config,
                            common_args(assets, folder / "resumed", assets["ranks"], PER_RANK) + layout_args +
                            checkpointing(folder / "checkpoint", seed=seed, load_step=SAVED_AT))
            weights = checkpoint(folder / "checkpoint" / f"step-{STEPS}")
            failures += compare(label, logged(folder / "first"), logged(folder / "resumed"), weights,
                                (ref_steps, ref_weights), exact_norm)
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print(f"torch_titan_trainer_test: python -m torchtitan.train with DMuon, both modes, FSDP 2 and TP 2 x FSDP 2, "
          f"a CheckpointManager resume, against one process; the jobs took {total:.0f} s; "
          f"{'FAIL' if failures else 'PASS'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
