"""Worker of the memory-model tests: trains a few steps and reports its measured peak memory.

Run as ``python tests/memory_probe.py '<json args>'`` once per worker; for ddp/fsdp the usual
torch.distributed variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are set by
the test. Prints one JSON line: ``baseline_bytes`` (VmRSS after imports, process-group set-up
and two steps of ``tiny_cnn``, before the model and the batch exist), ``peak_bytes`` (VmHWM over the measured steps, the high-water mark having been reset
after the warm-up steps), their difference ``training_bytes``, and the strategy's details.

Run it with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation of 64 KiB or more
separately and unmaps it on free, so the resident set follows the live tensors instead of
keeping freed heap memory (otherwise RSS after a step includes activations freed long ago).
"""

import gc
import json
import os
import sys


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    import torch

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    from ddlscope.config import RunConfig
    from ddlscope.strategies import WorkerContext, strategy_class
    from ddlscope.workloads.models import build_model, input_spec
    from ddlscope.workloads.step import loss_function, optimizer_for

    workers = args["workers"]
    cfg = RunConfig(strategy=args["strategy"], model=args["network"], dataset=args["dataset"],
                    batch_size=args["batch_size"], peers=workers, sample_budget=10**6,
                    optimizer=args.get("optimizer", "sgd"),
                    **({"distributed": args["distributed"]} if "distributed" in args else {}))
    import os

    rank = int(os.environ.get("RANK", "0"))
    ctx = WorkerContext(run_id="memprobe", worker_index=rank, num_workers=workers, cores=[0], initial_peers=[])
    strategy = strategy_class(cfg.strategy)(cfg, ctx)
    if hasattr(strategy, "init_process_group"):
        strategy.init_process_group()
    spec = input_spec(args["family"])
    loss_fn = loss_function()
    b = args["batch_size"]
    # the lazy imports and kernel code of a first training step, outside the measured steps
    tiny = build_model("tiny_cnn", args["family"])
    tiny_optimizer = optimizer_for(cfg, tiny.parameters())
    for _ in range(2):
        loss_fn(tiny(torch.randn(2, spec.channels, spec.height, spec.width)),
                torch.randint(0, spec.num_classes, (2,))).backward()
        tiny_optimizer.step()
    del tiny, tiny_optimizer
    gc.collect()
    baseline = status("VmRSS")
    x = torch.randn(b, spec.channels, spec.height, spec.width)  # the input batch counts as activation memory
    y = torch.randint(0, spec.num_classes, (b,))
    torch.manual_seed(0)
    model = build_model(cfg.model, args["family"])
    optimizer = optimizer_for(cfg, model.parameters())
    model = strategy.setup(model, optimizer)
    model.train()

    def step() -> None:
        strategy.forward_backward(model, x, y, loss_fn)
        strategy.step(b)
        strategy.zero_grad()

    for _ in range(args.get("warmup", 2)):
        step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(args.get("steps", 1)):
        step()
    peak = status("VmHWM")
    details = strategy.details()
    strategy.close()
    print(json.dumps({"rank": rank, "details": details, "baseline_bytes": baseline, "peak_bytes": peak,
                      "training_bytes": peak - baseline}))


if __name__ == "__main__":
    main()
    # skip interpreter teardown: destroying a gloo process group there can deadlock (see dist_check.py)
    sys.stdout.flush()
    os._exit(0)
