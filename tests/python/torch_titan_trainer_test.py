"""torchtitan's own Trainer with DMuon, as its users run it (issue 62): `python -m torchtitan.train --module
titan_trainer_config --config ...` (examples/titan_trainer_config.py as it is: torchtitan's Llama3 debug config,
6 layers, with DMuon) on the CPU (its _cpu functions: dmuon.torch.titan_cpu.on_cpu), with the assets
examples/titan_assets.py makes (its tokenizer; documents of SEQ - 1 words, each one row of SEQ tokens) and float32
FSDP2 parameters (torchtitan applies FSDP2 at every world size, one rank's too; with its bfloat16 default the one
process's step-1 loss was 2.7e-5 from the jobs', whose bfloat16 products differ).

In this process first (a process group of one rank):
  refusal      owner_held under torchtitan's Trainer itself (not DMuonTrainer) stops as the Trainer is built, naming
               DMuonTrainer and training.max_norm (its train_step's clipping cannot read held gradients);
  one process  the Trainer of llama3_dmuon_cpu, trained for STEPS steps with both data-parallel ranks' rows a step
               (Trainer.train(), as torchtitan.train runs it), its CheckpointManager saving step 0 (the seed every
               job loads: --checkpoint.initial_load_path) and every SAVED_AT steps; and, from the seed, the step-1
               gradient norm summed in float64 (torch's float32 norm of the unsharded model, the Trainer's in one
               process, was 8.9e-5 from it, so the jobs' step-1 norms are held to this one).
Then the jobs, each launched by run_ranks.py (the ranks forked, a hard timeout), for each layout (2 ranks: FSDP 2;
4 ranks: TP 2 x FSDP 2):
  all-to-all   llama3_dmuon_cpu (torchtitan's Trainer), STEPS steps, its CheckpointManager saving every SAVED_AT
  owner-held   llama3_dmuon_owner_held_cpu (DMuonTrainer), the same
  resumed      a new job from the owner-held job's checkpoint of step SAVED_AT (--checkpoint.load_step), the steps
               after it: at 2 ranks owner-held again, at 4 ranks all-to-all (a held checkpoint read by the other mode)
Both layouts have 2 data-parallel ranks; each rank's dataset shard (torchtitan takes a contiguous half of the
documents) holds, step by step, the rows the one process's dataset holds for that step.
Checks: every job's losses (the Trainer's own, read from its TensorBoard events) equal the one process's, and its
step-1 gradient norm the float64 one, within framework_runs.TOLERANCE; the resumed job's steps equal the job it
resumed bit for bit in the same mode (within TOLERANCE in the other), and its final weights (its last checkpoint)
the one process's.

Needs torchtitan's Trainer packages (python/requirements-titan-trainer.txt; `make titan-trainer-packages` puts them
in build/titan_trainer_packages, which ctest puts on this test's PYTHONPATH).

Run: PYTHONPATH=build/python:build/titan_trainer_packages python tests/python/torch_titan_trainer_test.py OUT
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
EXAMPLES = HERE.parent.parent / "examples"  # titan_trainer_config (the jobs' --module) and titan_assets
sys.path[:0] = [str(EXAMPLES)]

STEPS, SAVED_AT = 4, 2
DP, PER_RANK, SEQ = 2, 2, 32  # data-parallel ranks, rows a rank a step, tokens a row
LAUNCH_TIMEOUT_S = 240
# imported by run_ranks.py before it forks the ranks (about 3 s of CPU a rank; none starts a thread): the torch
# modules torchtitan.trainer imports (pyarrow's, through datasets, start jemalloc's thread: the ranks import them)
PRELOAD = ("torch._inductor.compile_fx", "torch.distributed.pipelining")
ALL_TO_ALL, OWNER_HELD = "llama3_dmuon_cpu", "llama3_dmuon_owner_held_cpu"
# (layout, ranks, its options, the resumed job's config)
LAYOUTS = (("fsdp2", 2, [], OWNER_HELD),
           ("tp2-fsdp2", 4, ["--parallelism.tensor_parallel_degree", "2"], ALL_TO_ALL))


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
    same rows each step. ({name: folder}, the documents of step 1)."""
    import titan_assets

    titan_assets.write_tokenizer(out / "tokenizer")
    docs = titan_assets.documents(STEPS * DP * PER_RANK, SEQ - 1, seed=0)
    row = {(s, r, i): docs[(s * DP + r) * PER_RANK + i] for s in range(STEPS) for r in range(DP) for i in range(PER_RANK)}
    order = sorted(row)  # one process: step by step, each step the ranks' rows
    by_rank = sorted(row, key=lambda k: (k[1], k[0], k[2]))  # rank r's contiguous half: its rows step by step
    titan_assets.write_dataset(out / "data-one", [row[k] for k in order])
    titan_assets.write_dataset(out / "data-ranks", [row[k] for k in by_rank])
    return {"tokenizer": out / "tokenizer", "one": out / "data-one", "ranks": out / "data-ranks"}, \
        [row[k] for k in order[:DP * PER_RANK]]


def launch(out, label, nproc, config, args):
    """`python -m torchtitan.train --module titan_trainer_config --config CONFIG ARGS` on nproc ranks, its output in
    out/label.log; seconds it took. Exits 1 (its log's tail printed) if it fails."""
    command = [sys.executable, str(HERE / "run_ranks.py"), "--nproc", str(nproc), "--timeout", str(LAUNCH_TIMEOUT_S),
               *(f"--preload={m}" for m in PRELOAD), "--", "-m", "torchtitan.train",
               "--module", "titan_trainer_config", "--config", config, *args]
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


def job_args(assets, dump, folder, seed, load_step=None):
    """A job's options: the data-parallel ranks' dataset, STEPS steps, TensorBoard events in dump/tb, full
    checkpoints (llama3_debugmodel's last_save_model_only=False) every SAVED_AT steps in `folder`, the seed's
    weights to start from (or the checkpoint of load_step)."""
    args = ["--hf_assets_path", str(assets["tokenizer"]), "--dataloader.dataset_path", str(assets["ranks"]),
            "--training.steps", str(STEPS), "--training.seq_len", str(SEQ), "--training.local_batch_size",
            str(PER_RANK), "--training.mixed_precision_param", "float32", "--dump_folder", str(dump),
            "--metrics.enable_tensorboard", "--metrics.disable_color_printing",
            "--checkpoint.enable", "--checkpoint.folder", str(folder), "--checkpoint.interval", str(SAVED_AT),
            "--checkpoint.initial_load_path", str(seed)]
    return args + (["--checkpoint.load_step", str(load_step)] if load_step is not None else [])


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


def model_weights(folder):
    """The model's weights in the DCP checkpoint `folder`, read in this process: the checkpoint's tensors at its
    top (the optimizer's, the schedulers', the dataloader's and the train state are dicts)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, whole)
    return {k: v for k, v in torch.load(whole, weights_only=False).items() if isinstance(v, torch.Tensor)}


def refused_under_plain_trainer(assets):
    """Failures of owner_held under torchtitan's Trainer (the module's text): [text]."""
    from torchtitan.trainer import Trainer

    import titan_trainer_config

    config = titan_trainer_config.llama3_dmuon_owner_held_cpu()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    try:
        Trainer.Config(**{**fields, "hf_assets_path": str(assets["tokenizer"]), "dataloader": dataclasses.replace(
            config.dataloader, dataset_path=str(assets["one"]))}).build()
        return ["owner_held under torchtitan's Trainer was not refused"]
    except ValueError as e:
        if "DMuonTrainer" not in str(e) or "training.max_norm=1.0" not in str(e):
            return [f"the refusal of owner_held under torchtitan's Trainer names no remedy: {e}"]
    return []


def step1_norm(trainer, docs):
    """The float64 norm of the gradient of step 1's rows (`docs`, tokenized as torchtitan's dataset does: BOS, the
    words, EOS; the row its first SEQ tokens, the labels its last) on the trainer's model as it is."""
    import torch

    tokens = torch.tensor([trainer.tokenizer.encode(d, add_bos=True, add_eos=True) for d in docs])
    positions = torch.arange(SEQ).expand(len(docs), -1)
    model = trainer.model_parts[0]
    loss, _ = trainer.loss_fn(model(tokens[:, :-1], positions=positions), tokens[:, 1:],
                              torch.tensor(tokens[:, 1:].numel()), positions=positions)
    loss.backward()
    norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
    model.zero_grad(set_to_none=True)
    return norm


def one_process(assets, docs, out):
    """The refusal and the one process (the module's text): ([failures], the seed's folder, the step-1 norm, the
    one process's {step: (loss, gradient norm)} and final weights)."""
    import torch.distributed as dist

    import titan_trainer_config

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the Trainer then skips its own
    os.environ.setdefault("LOCAL_RANK", "0")
    failures = refused_under_plain_trainer(assets)
    config = titan_trainer_config.llama3_dmuon_cpu()
    config.hf_assets_path, config.dump_folder = str(assets["tokenizer"]), str(out)
    config.dataloader = dataclasses.replace(config.dataloader, dataset_path=str(assets["one"]))
    config.training = dataclasses.replace(config.training, seq_len=SEQ, local_batch_size=DP * PER_RANK, steps=STEPS,
                                          mixed_precision_param="float32")
    config.checkpoint = dataclasses.replace(config.checkpoint, enable=True, interval=SAVED_AT)
    config.metrics = dataclasses.replace(config.metrics, enable_tensorboard=True, disable_color_printing=True)
    trainer = config.build()
    trainer.checkpointer.save(curr_step=0)  # the seed (a step-0 checkpoint, which train() then loads: the same)
    norm = step1_norm(trainer, docs)
    trainer.train()
    trainer.close()
    dist.destroy_process_group()
    folder = out / "checkpoint"
    return failures, folder / "step-0", norm, logged(out), model_weights(folder / f"step-{STEPS}")


def compare(label, steps, exact_norm, reference):
    """Failures of a job from step 1 against the one process (the module's text): [text]."""
    from framework_runs import TOLERANCE

    ref_steps, _ = reference
    if sorted(steps) != list(range(1, STEPS + 1)):
        return [f"{label}: steps logged {sorted(steps)}"]
    failures = []
    losses = {s: loss for s, (loss, _) in steps.items()}
    if any(abs(losses[s] - ref_steps[s][0]) > TOLERANCE * abs(ref_steps[s][0]) for s in losses):
        failures.append(f"{label}: losses {losses}, the one process's { {s: l for s, (l, _) in ref_steps.items()} }")
    if abs(steps[1][1] - exact_norm) > TOLERANCE * exact_norm:
        failures.append(f"{label}: the step-1 gradient norm {steps[1][1]:.6f}, the one process's {exact_norm:.6f}")
    print(f"{label}: losses {[f'{l:.6f}' for l in losses.values()]} (one process "
          f"{[f'{l:.6f}' for l, _ in ref_steps.values()]}), step-1 gradient norm {steps[1][1]:.6f} (one process "
          f"{exact_norm:.6f})", flush=True)
    return failures


def compare_resumed(label, steps, source, same_mode, weights, reference):
    """Failures of a resumed job against the job it resumed (`source`'s steps) and the one process: [text]."""
    from framework_runs import TOLERANCE

    ref_steps, ref_weights = reference
    if sorted(steps) != list(range(SAVED_AT + 1, STEPS + 1)):
        return [f"{label}: steps logged {sorted(steps)}"]
    failures = []
    for s, (loss, norm) in steps.items():
        near = all(abs(a - b) <= TOLERANCE * abs(b) for a, b in ((loss, source[s][0]), (norm, source[s][1]),
                                                                 (loss, ref_steps[s][0])))
        if not near or (same_mode and (loss, norm) != source[s]):  # the same job's steps again: bit for bit
            failures.append(f"{label} step {s}: loss {loss:.7f}, gradient norm {norm:.7f}; without the resume "
                            f"{source[s][0]:.7f}, {source[s][1]:.7f}; the one process's loss {ref_steps[s][0]:.7f}")
    for k, v in ref_weights.items():
        gap = (weights[k] - v).abs().max().item() if k in weights else float("inf")
        if gap > TOLERANCE * max(1.0, v.abs().max().item()):
            failures.append(f"{label}: the final '{k}' differs from the one process's by {gap:.3g}")
    print(f"{label}: steps {sorted(steps)} {'bit for bit' if same_mode else 'within tolerance'} as without the "
          f"resume; final weights as the one process's ({len(ref_weights)} tensors)", flush=True)
    return failures


def main():
    out = pathlib.Path(sys.argv[1]).resolve()
    packages_or_exit()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ.update(HF_HOME=str(out / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # nothing fetched
    os.environ["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])])
    assets, step1_docs = make_assets(out / "assets")
    start = time.monotonic()
    failures, seed, exact_norm, *reference = one_process(assets, step1_docs, out / "one-process")
    print(f"one process: {time.monotonic() - start:.0f} s", flush=True)
    total = 0.0
    for layout, nproc, layout_args, resumed_config in LAYOUTS:
        jobs = {}
        for mode, config in (("all-to-all", ALL_TO_ALL), ("owner-held", OWNER_HELD)):
            folder = out / f"{layout}-{mode}"
            total += launch(out, f"{layout}-{mode}", nproc, config,
                            job_args(assets, folder, folder / "checkpoint", seed) + layout_args)
            jobs[config] = logged(folder)
            failures += compare(f"{layout} {mode}", jobs[config], exact_norm, reference)
        source = out / f"{layout}-owner-held"
        label = f"{layout} {'owner-held' if resumed_config == OWNER_HELD else 'all-to-all'} resumed from owner-held"
        folder = out / f"{layout}-resumed"
        total += launch(out, f"{layout}-resumed", nproc, resumed_config,
                        job_args(assets, folder, source / "checkpoint", seed, load_step=SAVED_AT) + layout_args)
        failures += compare_resumed(label, logged(folder), jobs[OWNER_HELD], resumed_config == OWNER_HELD,
                                    model_weights(source / "checkpoint" / f"step-{STEPS}"), reference)
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print(f"torch_titan_trainer_test: python -m torchtitan.train with DMuon, both modes, FSDP 2 and TP 2 x FSDP 2, "
          f"CheckpointManager resumes, against the Trainer in one process; the jobs took {total:.0f} s; "
          f"{'FAIL' if failures else 'PASS'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
