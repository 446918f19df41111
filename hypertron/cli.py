"""The ``hypertron`` command: parse, then call one function.

User mistakes (bad config, missing files, unusable checkpoints) end with one
line on stderr naming the problem and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from hypertron.config import TOKENIZABLE_SOURCES, ServeConfig, choices, load_serve_config
from hypertron.config.schema import WeightQuantization
from hypertron.errors import UserError


def _config(args: argparse.Namespace):
    """The config of ``[RECIPE] key=value ...`` (train, plan)."""
    from hypertron.config import load_config

    recipe, overrides = None, list(args.overrides)
    if overrides and "=" not in overrides[0]:
        recipe = overrides.pop(0)
    return load_config(recipe, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from hypertron.train.loop import train

    trackers = []
    if cfg.monitor.collect or cfg.monitor.port:
        from hypertron.monitor.collector import Collector

        trackers.append(Collector(cfg.run_dir, cfg.monitor))
    result = train(cfg, trackers=trackers)
    return cfg.train.preempt_exit_code if result.status == "preempted" else 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from hypertron.models import plan as planner

    cfg = _config(args)
    if cfg.task == "dlrm":
        return _plan_dlrm(cfg, args)
    p = planner.plan(cfg, args.hardware, args.devices)
    if args.json:
        print(json.dumps(planner.to_json(p), indent=1))
    else:
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits is not False else 1


def _plan_dlrm(cfg, args: argparse.Namespace) -> int:
    """``hypertron plan`` of a recommender: its sizes (abstract shapes) and its tables placed over
    ``--devices`` of ``--hardware`` by the embedding planner; exit 1 when they do not fit."""
    import json

    from rich.console import Console

    from hypertron.config import ConfigError
    from hypertron.embed import plan as planner
    from hypertron.embed.spec import gib
    from hypertron.models.hardware import HARDWARE, host_memory_per_device
    from hypertron.recsys import dlrm

    if args.hardware not in HARDWARE:
        raise ConfigError(f"--hardware={args.hardware!r}: not one of {', '.join(HARDWARE)}")
    hw = HARDWARE[args.hardware]
    devices = args.devices or hw.per_node
    d = cfg.dlrm
    tables, features = dlrm.table_specs(d, d.placement)
    sizes = dlrm.sizes(d)
    dense = 4 * sizes["dense_params"] * (1 if d.optimizer == "sgd" else 2)  # replicated: parameters (+ Adagrad)
    memory = int(hw.memory or host_memory_per_device(devices)) - dense
    p = planner.plan(tables, features, {f.name: float(h) for f, h in zip(features, d.ids_per_sample)},
                     shards=devices, batch=cfg.train.global_batch, device_bytes=max(memory, 1))
    if args.json:
        print(json.dumps({"dlrm": d.name, **sizes, "dense_bytes_per_device": dense, "tables": planner.to_json(p)},
                         indent=1))
    else:
        Console(soft_wrap=True).print(
            f"{d.name}: {sizes['params']:,} parameters ({sizes['table_params']:,} in {len(tables)} tables, "
            f"{sizes['dense_params']:,} dense); with {d.optimizer}'s state "
            f"{gib(sizes['param_bytes'] + sizes['optimizer_bytes'])} in all; every device also holds the MLPs "
            f"({gib(dense)}), so the tables have {gib(max(memory, 0))} of each",
            highlight=False)
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from hypertron.config import ConfigError
    from hypertron.serve.generate import generate
    from hypertron.serve.model import load_model

    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}: must be positive")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature}: must not be negative")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k}: must not be negative (0 = off)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p}: must be in (0, 1]")
    model, params, tok = load_model(args.checkpoint, args.quantize)
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    if len(ids) + args.max_new_tokens > model.max_seq_len:
        raise ConfigError(
            f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds model.max_seq_len={model.max_seq_len}"
        )
    (out,) = generate(
        params, model, [ids], args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_ids=tok.eos_ids,
    )
    print(args.prompt + tok.decode(out))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hypertron.checkpoint import load_params
    from hypertron.config import ConfigError
    from hypertron.models import bundle, hf

    if bool(args.from_hf) == bool(args.to_hf):
        raise ConfigError("convert: give exactly one of --from-hf DIR or --to-hf DIR")
    if args.from_hf:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"{out} already exists and is not an empty directory; choose a new one")
        model_cfg, params = hf.load_hf(args.from_hf)
        has_tokenizer = any((Path(args.from_hf) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        bundle.save_model(out, model_cfg, params, args.from_hf if has_tokenizer else "byte")
        print(f"wrote the model bundle {out} ({model_cfg.name})")
    else:
        if not args.checkpoint:
            raise ConfigError("convert --to-hf needs --checkpoint RUN_DIR (or a model bundle)")
        if bundle.is_bundle(args.checkpoint):
            _, tokenizer = bundle.read_config(args.checkpoint)
            model_cfg, params, _ = bundle.load_model(args.checkpoint)
        else:
            cfg, params = load_params(args.checkpoint)
            model_cfg, tokenizer = cfg.model, cfg.data.tokenizer
        hf.save_hf(args.to_hf, model_cfg, params)
        copied = bundle.copy_tokenizer(tokenizer, args.to_hf, names=("tokenizer.json", "tokenizer.model"))
        print(f"wrote Hugging Face checkpoint {args.to_hf}" + (" with its tokenizer" if copied else ""))
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    from hypertron.monitor import report as mon

    def build():
        now = time.time()
        return mon.build(args.run_dir, now=now, hang_factor=args.hang_factor, hang_min=args.hang_min,
                         window=mon.window_of(args.since, args.window, now),
                         straggler_threshold=args.straggler_threshold, top=args.top)

    if args.hang_factor <= 0 or args.hang_min < 0:
        raise mon.MonitorError("--hang-factor must be positive and --hang-min not negative")
    if not 0 < args.straggler_threshold <= 1 or args.top < 1:
        raise mon.MonitorError("--straggler-threshold must be in (0, 1] and --top at least 1")
    if args.serve:
        from hypertron.monitor import dashboard

        if not 0 < args.refresh <= 3600 or not 0 <= args.port <= 65535:
            raise mon.MonitorError("--refresh must be in (0, 3600] seconds and --port in 0..65535")
        mon.window_of(args.since, args.window, time.time())  # a bad --since or --window: one line now
        if args.json or args.follow is not None:
            raise mon.MonitorError("--serve shows the run on a page: --json and --follow do not apply")
        if not os.path.isdir(args.run_dir):
            raise mon.MonitorError(f"{args.run_dir} is not a directory")
        try:
            dashboard.serve(args.run_dir, build, args.host, args.port, args.refresh)
        except KeyboardInterrupt:
            pass
        return 0
    if args.follow is None:
        rep = build()
        if args.json:
            print(json.dumps(mon.to_json(rep), indent=1, default=str))
        else:
            Console(soft_wrap=True).print(mon.render(rep))
        return 1 if rep.alarms else 0
    from rich.live import Live

    console = Console()
    with Live(mon.render(build()), console=console, refresh_per_second=1, screen=False) as live:
        while True:
            time.sleep(args.follow)
            rep = build()
            live.update(mon.render(rep))
            if rep.goodput is not None and rep.goodput.jobs[-1].status != mon.RUNNING:
                return 1 if rep.alarms else 0


def cmd_embed_plan(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from hypertron.config import ConfigError, read_yaml
    from hypertron.embed import plan as planner
    from hypertron.models.hardware import HARDWARE, host_memory_per_device

    doc = read_yaml(args.spec, "embedding tables file")
    tables, features, per, batch = planner.load(doc, args.spec)
    if args.batch is not None:
        batch = args.batch
    if args.hardware not in HARDWARE:
        raise ConfigError(f"--hardware={args.hardware!r}: not one of {', '.join(HARDWARE)}")
    hw = HARDWARE[args.hardware]
    devices = args.devices or hw.per_node
    memory = args.device_memory or hw.memory or host_memory_per_device(devices)
    p = planner.plan(tables, features, per, shards=devices, batch=batch, device_bytes=int(memory))
    if args.json:
        print(json.dumps(planner.to_json(p), indent=1))
    else:
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits else 1


def _bytes_arg(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12}
    number = text.rstrip("bBkKmMgGtTiI ")
    unit = text[len(number):].strip().lower()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r}: not a size (e.g. 80GB, 16GiB, 1e9)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return int(value)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from hypertron.data.pretokenize import tokenize_corpus

    metadata = tokenize_corpus(
        source=args.source, paths=tuple(args.paths), text_field=args.text_field,
        tokenizer=args.tokenizer, out=args.out, log=lambda line: print(line, file=sys.stderr),
    )
    print(f"wrote {metadata['num_documents']} documents, {metadata['num_tokens']} tokens in "
          f"{len(metadata['shards'])} shards to {args.out} (train with data.source=tokens)")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from hypertron.launch.local import launch_local, launch_recipe

    if args.recipe:
        if args.processes is not None or args.cpu_devices is not None:
            raise UserError("launch local --recipe: the recipe gives the processes and devices "
                            "(no --processes or --cpu-devices)")
        if args.cmd and args.cmd[0] == "--":
            args.cmd = args.cmd[1:]
        if any("=" not in c for c in args.cmd):
            raise UserError("launch local --recipe R: only key=value overrides may follow")
        return launch_recipe(args.recipe, args.cmd, gpus=args.gpus)
    if args.processes is None:
        raise UserError("launch local: give --processes N (and the command after --), or --recipe R")
    return launch_local(args.cmd, processes=args.processes, cpu_devices=args.cpu_devices, gpus=args.gpus)


def cmd_recipes(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from hypertron.launch import recipes
    from hypertron.models.memory import describe

    if args.name:
        r = recipes.load(args.name, args.nodes)
        p = r.predict()
        if args.json:
            print(json.dumps(_recipe_json(r, p), indent=1))
            return 0
        from hypertron.config import dump_yaml
        from hypertron.models import plan as planner

        console = Console(soft_wrap=True, highlight=False)
        console.print(f"[bold]{r.name}[/bold]: {r.machine.name} ({r.machine.note}) x {r.nodes} nodes")
        for title, settings in (("XLA flags", r.cfg.launch.xla_flags), ("environment", r.cfg.launch.env)):
            if settings:
                console.print(f"[bold]{title}[/bold]")
                for st in settings:
                    console.print(f"  {st.value}  [dim]{st.reason}[/dim]")
        console.print(planner.render(p))
        if args.config:
            print(dump_yaml(r.cfg))
        return 0
    rows = []
    for name in recipes.names():
        r = recipes.load(name, args.nodes)
        rows.append((r, r.predict()))
    if args.json:
        print(json.dumps([_recipe_json(r, p) for r, p in rows], indent=1))
        return 0
    table = Table(show_edge=False)
    for col in ("recipe", "nodes", "devices", "mesh", "batch x seq", "memory per device", "of", "fits"):
        table.add_column(col, justify="right" if col in ("nodes", "devices", "memory per device", "of") else "left",
                         no_wrap=True)
    for r, p in rows:
        mesh = " x ".join(f"{a} {n}" for a, n in r.mesh.items() if n > 1) or "1 device"
        table.add_row(r.name, str(r.nodes), str(r.devices), mesh, f"{r.cfg.train.global_batch} x {r.cfg.train.seq_len}",
                      describe(p.memory.total), describe(p.device_memory) if p.device_memory else "?",
                      {True: "yes", False: "NO", None: "?"}[p.fits])
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)
    return 0


def _recipe_json(r, p) -> dict:
    from hypertron.models import plan as planner

    return {"recipe": r.name, "machine": r.machine.name, "nodes": r.nodes, "devices": r.devices, "mesh": r.mesh,
            "model": r.cfg.model.name, "xla_flags": r.xla_flags(), "env": r.env(), "plan": planner.to_json(p)}


def _recipe_that_fits(args: argparse.Namespace):
    """The recipe of ``workload create``, refused in one line when the memory model says it cannot fit."""
    from hypertron.launch import recipes

    recipe = recipes.load(args.recipe, args.nodes, args.overrides)
    p = recipe.predict()
    if p.fits is False and recipe.cfg.train.memory_check:
        from hypertron.models.memory import describe

        raise UserError(f"recipe {recipe.name} on {recipe.nodes} nodes needs {describe(p.memory.total)} per device, "
                        f"more than the {describe(p.device_memory)} of a {p.hardware.name} (hypertron recipes "
                        f"{recipe.name} shows the parts; train.memory_check=false submits anyway)")
    return recipe


def _workload(args: argparse.Namespace):
    from hypertron.launch import k8s

    if not args.storage:
        raise UserError("--storage: give the shared storage the run directory lives on, pvc:CLAIM or gs://BUCKET "
                        "(a restart on a node's own disk would lose every checkpoint)")
    image = args.image or os.environ.get("HYPERTRON_IMAGE", "")
    return k8s.Workload(args.name, _recipe_that_fits(args), image=image, storage=args.storage, priority=args.priority,
                        max_restarts=args.max_restarts, queue=args.queue, namespace=args.namespace)


def _render_or_apply(objects: list[dict], args: argparse.Namespace, what: str, create_only: bool) -> int:
    from hypertron.launch import k8s, validate

    validate.check(objects)
    text = k8s.to_yaml(objects)
    if not args.dry_run and not args.output:
        from hypertron.launch import cluster

        cluster.api()  # no cluster to apply to: one line now, before anything is shown or sent
    if args.output:
        out = os.path.abspath(args.output)
        if os.path.exists(out):
            raise UserError(f"--output {args.output} already exists; choose a new file (nothing is overwritten)")
        try:
            with open(out, "x") as f:
                f.write(text)
        except OSError as e:
            raise UserError(f"--output {args.output}: {e.strerror}") from None
        print(f"wrote {len(objects)} objects to {args.output} (valid for Kubernetes {validate.KUBERNETES}); "
              f"apply them with kubectl apply -f {args.output}")
        return 0
    print(text, end="")
    if args.dry_run:
        return 0
    done = cluster.apply(objects, create_only=create_only)
    print(f"{what}: " + ", ".join(done), file=sys.stderr)
    return 0


def _slurm_workload(args: argparse.Namespace) -> int:
    from hypertron.launch import slurm

    if args.action == "create":
        job = slurm.Job(args.name, _recipe_that_fits(args), storage=args.storage or "runs",
                        partition=args.partition or "", time=args.time or "")
        slurm.check(job)
        if args.dry_run or args.output:
            text = slurm.script(job)
            if args.dry_run:
                print(text, end="")
                return 0
            if os.path.exists(args.output):
                raise UserError(f"--output {args.output} already exists; choose a new file (nothing is overwritten)")
            try:
                with open(args.output, "x") as f:
                    f.write(text)
            except OSError as e:
                raise UserError(f"--output {args.output}: {e.strerror}") from None
            print(f"wrote the sbatch script to {args.output}")
            return 0
        job_id, path = slurm.submit(job)
        print(f"submitted Slurm job {job_id} ({path}); its output: {job.run_dir}/slurm-{job_id}.out")
    elif args.action == "list":
        from rich.console import Console
        from rich.table import Table

        table = Table(show_edge=False)
        for col in ("id", "name", "state", "nodes", "time", "reason", "directory"):
            table.add_column(col)
        for r in slurm.jobs():
            table.add_row(r["id"], r["name"], r["state"], r["nodes"], r["time"], r["reason"], r["workdir"])
        Console(soft_wrap=True).print(table)
    elif args.action == "describe":
        print(slurm.describe(args.name), end="")
    elif args.action == "logs":
        print(slurm.logs(args.name, args.storage or "runs"), end="")
    else:
        print("cancelled Slurm job " + ", ".join(slurm.cancel(args.name)))
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from hypertron.launch import cluster, k8s

    if args.scheduler == "slurm":
        return _slurm_workload(args)
    for flag in ("partition", "time"):
        if getattr(args, flag, None):
            raise UserError(f"--{flag} is a Slurm setting (with --scheduler slurm)")
    if args.action == "create":
        w = _workload(args)
        return _render_or_apply(k8s.workload_objects(w), args, f"created workload {w.name}", create_only=True)
    if args.action == "list":
        from rich.console import Console
        from rich.table import Table

        table = Table(show_edge=False)
        for col in ("name", "recipe", "nodes", "status", "restarts", "age"):
            table.add_column(col)
        for r in cluster.list_workloads(args.namespace):
            table.add_row(r["name"], r["recipe"], str(r["nodes"]), r["status"], str(r["restarts"]),
                          cluster.age(r["created"]))
        Console(soft_wrap=True).print(table)
    elif args.action == "describe":
        import json

        print(json.dumps(cluster.describe(args.name, args.namespace), indent=1, default=str))
    elif args.action == "logs":
        print(cluster.logs(args.name, args.namespace, args.process), end="")
    else:
        print("deleted " + ", ".join(cluster.delete(args.name, args.namespace)))
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from hypertron.launch import k8s, machines

    objects = k8s.cluster_objects(machines.machine(args.hardware), args.nodes, args.queue, args.namespace)
    return _render_or_apply(objects, args, "applied", create_only=False)


# The flags of `hypertron serve`, one per ServeConfig key (`max_slots` is --max-slots): their types,
# choices and defaults come from the schema; only the help text and metavar are written here.
_SERVE_FLAGS: dict[str, dict] = {
    "checkpoint": dict(metavar="DIR", aliases=("--model",),
                       help="run directory (its latest checkpoint) or Hugging Face model directory; required"),
    "host": dict(help="address to bind"),
    "port": dict(),
    "api_key": dict(metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 endpoints"),
    "max_slots": dict(metavar="N", help="sequences decoding at once, at most"),
    "max_num_batched_tokens": dict(metavar="N", help="tokens per engine step: decode tokens + prompt chunks "
                                                     "(a longer prompt is prefilled over several steps)"),
    "max_prefill_rows": dict(metavar="N", help="prompts or prompt chunks per step, at most"),
    "page_size": dict(metavar="N", help="tokens per KV page"),
    "num_pages": dict(metavar="N", help="KV pages (default: every slot at max_seq_len)"),
    "kv_cache_dtype": dict(help="auto = the model's compute dtype"),
    "quantize": dict(help="weight precision"),
    "compile": dict(help="background: a new step shape compiles in the background while its steps run "
                         "padded to a compiled shape at most twice as costly (if any); lazy: a step waits for "
                         "its shape's compile"),
    "dispatch_ahead": dict(help="dispatch each step before the last one's tokens reach the host; auto: on "
                                "an accelerator, and for steps of at most 8 tokens on a CPU"),
    "max_queue": dict(metavar="N", help="requests waiting for a slot before new ones get 429"),
    "max_prompt_tokens": dict(metavar="N", help="default: max_seq_len - 1"),
    "max_tokens_limit": dict(metavar="N", help="largest max_tokens (default: max_seq_len)"),
    "model_name": dict(metavar="NAME", help="the id in /v1/models (default: the run directory's name)"),
}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`ServeConfig` field; a flag not given is left out of the namespace, so
    that a ``--config`` file's value stands unless a flag overrides it."""
    hints = typing.get_type_hints(ServeConfig)
    missing = {f.name for f in dataclasses.fields(ServeConfig)} ^ set(_SERVE_FLAGS)
    assert not missing, f"ServeConfig fields and serve flags differ: {missing}"
    for field in dataclasses.fields(ServeConfig):
        tp = hints[field.name]
        kind = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # int | None -> int
        options = dict(_SERVE_FLAGS[field.name], default=argparse.SUPPRESS)
        aliases = options.pop("aliases", ())
        if typing.get_origin(tp) is typing.Literal:
            options["choices"] = choices(tp)
        elif kind is int:
            options["type"] = int
        if field.default not in (None, ""):
            options["help"] = (options.get("help", "") + f" (default {field.default})").strip()
        parser.add_argument(_flag(field.name), *aliases, dest=field.name, **options)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of ``hypertron serve``'s arguments: ``--config FILE`` (if given),
    then the flags typed, which win. Messages name a flag as typed and a key by its file."""
    given = {k: v for k, v in vars(args).items() if k in _SERVE_FLAGS}

    def name(key: str) -> str:
        return f"{args.config}: {key}" if args.config and key not in given else _flag(key)

    return load_serve_config(args.config, given, name)


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config_from_args(args)
    from hypertron.serve.server import main as serve_main

    return serve_main(cfg)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from hypertron.loadgen import BenchSettings, bench_serve

    names = {f.name for f in dataclasses.fields(BenchSettings)}
    return bench_serve(BenchSettings(**{k: v for k, v in vars(args).items() if k in names}))


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's own error shape: one ``error:`` line and exit code 2 (the usage is
    what ``--help`` shows)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _add_output_flags(parser: argparse.ArgumentParser, verb: str) -> None:
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--dry-run", action="store_true", help=f"print the objects; {verb} nothing")
    out.add_argument("--output", metavar="FILE", help=f"write the objects to a new FILE; {verb} nothing")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hypertron", description="Train and serve LLMs in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train", help="train a model",
        description="Train a model. Arguments: an optional YAML recipe, then key=value overrides "
        "(e.g. model=tiny train.steps=200 mesh.fsdp=-1). Resumes from the latest checkpoint in run_dir.",
    )
    t.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser(
        "plan", help="memory per device, compute and communication time of a training config, before launch",
        description="Plan a training run on hardware you may not have: per-device memory (parameters, "
        "gradients, optimiser state exact; activations estimated), compute time at the device's peak, "
        "communication per mesh axis, and the predicted step time and MFU. Exit 1 when it does not fit. "
        "docs/memory.md has the formulas.")
    pl.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    pl.add_argument("--hardware", default="h100", help="h100, h100-pcie, h100-nvl, h200, a100, tpu-v5p, tpu-v5e, "
                    "tpu-v6e or cpu (default %(default)s)")
    pl.add_argument("--devices", type=int, default=None, metavar="N", help="default: one node's")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="continue a prompt from a checkpoint")
    g.add_argument("--checkpoint", "--model", dest="checkpoint", required=True, metavar="DIR",
                   help="run directory (its latest checkpoint) or Hugging Face model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantize", choices=choices(WeightQuantization), default="none",
                   help="weight precision: int8 = int8 weights with per-channel scales, quantised after loading")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="import or export Hugging Face checkpoints")
    c.add_argument("--from-hf", metavar="DIR", help="HF directory (config.json + safetensors) to import")
    c.add_argument("--out", metavar="DIR", help="model bundle to write (with --from-hf): a new or empty directory")
    c.add_argument("--to-hf", metavar="DIR", help="HF directory to write (with --checkpoint)")
    c.add_argument("--checkpoint", "--model", dest="checkpoint", metavar="DIR",
                   help="model bundle or run directory to export (with --to-hf)")
    c.set_defaults(func=cmd_convert)

    la = sub.add_parser("launch", help="run a command as several cooperating processes")
    where = la.add_subparsers(dest="where", required=True)
    lo = where.add_parser(
        "local", help="N processes on this machine (jax.distributed over 127.0.0.1)",
        description="Start N processes of `hypertron COMMAND...` on this machine, joined by "
        "jax.distributed, e.g. `hypertron launch local --processes 2 --cpu-devices 4 -- train model=tiny`.",
    )
    lo.add_argument("--processes", type=int, metavar="N")
    lo.add_argument("--recipe", metavar="R", help="train this recipe as its processes (nodes x processes per node), "
                    "with its environment; key=value overrides may follow")
    lo.add_argument("--gpus", metavar="N_OR_LIST", help="split these GPUs (a count or 0,1,2,3) over the processes, "
                    "each its own CUDA_VISIBLE_DEVICES slice (default: the launcher's CUDA_VISIBLE_DEVICES)")
    lo.add_argument("--cpu-devices", type=int, default=None, metavar="K",
                    help="run on the CPU with K simulated devices per process")
    lo.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    lo.set_defaults(func=cmd_launch)

    rc = sub.add_parser(
        "recipes", help="the recipes per model x machine, with their predicted memory per device",
        description="List the recipes (recipes/<machine>/<model>.yaml) with their machine, node count, mesh and "
        "the memory model's prediction per device; with a NAME, its XLA flags and environment with their reasons "
        "and its whole plan.")
    rc.add_argument("name", nargs="?", metavar="NAME", help="one recipe, e.g. a3mega-h100/llama3.1-70b")
    rc.add_argument("--nodes", type=int, default=None, metavar="N", help="on N nodes (default: each recipe's own)")
    rc.add_argument("--json", action="store_true", help="print as JSON")
    rc.add_argument("--config", action="store_true", help="with NAME: also print the resolved config as YAML")
    rc.set_defaults(func=cmd_recipes)

    wl = sub.add_parser("workload", help="training workloads on Kubernetes (JobSet + Kueue) or Slurm (sbatch)")
    wla = wl.add_subparsers(dest="action", required=True)
    wc = wla.add_parser(
        "create", help="render, validate and submit a recipe as a JobSet",
        description="Render a recipe as a ConfigMap (the resolved recipe) and a JobSet of one pod per node, "
        "validate both strictly, print them, and submit them (or only print them with --dry-run, or write them "
        "with --output). key=value overrides after the options change the recipe. docs/launch.md shows the objects.")
    wc.add_argument("name", metavar="NAME", help="the workload's name (a DNS label; its pods' host names must "
                    "stay within 57 characters)")
    wc.add_argument("--recipe", required=True, metavar="R", help="a recipe name (a3mega-h100/llama3.1-70b) or YAML file")
    wc.add_argument("--nodes", type=int, default=None, metavar="N", help="default: the recipe's")
    wc.add_argument("--image", metavar="IMG", help="the container image with hypertron installed "
                    "(default: $HYPERTRON_IMAGE)")
    from hypertron.launch.machines import MACHINES, PRIORITIES

    wc.add_argument("--priority", default="medium", metavar="P",
                    help=f"{', '.join(PRIORITIES)} (default %(default)s)")
    wc.add_argument("--max-restarts", type=int, default=10, metavar="K",
                    help="gang restarts before the workload fails; each preemption or eviction uses one "
                    "(default %(default)s)")
    wc.add_argument("--queue", default="hypertron", metavar="Q", help="the Kueue LocalQueue (default %(default)s)")
    wc.add_argument("--storage", metavar="WHERE", help="where the run directory lives: pvc:CLAIM or gs://BUCKET; "
                    "with --scheduler slurm, a directory on the shared file system (default runs)")
    wc.add_argument("--partition", metavar="P", help="--scheduler slurm: the partition (default: the cluster's)")
    wc.add_argument("--time", metavar="T", help="--scheduler slurm: the time limit (minutes, HH:MM:SS, D-HH:MM)")
    wc.add_argument("--namespace", default="default", help="default %(default)s")
    _add_output_flags(wc, "submit")
    wc.add_argument("overrides", nargs="*", metavar="key=value")
    for action, text in (("list", "hypertron's workloads and their state"), ("describe", "a workload's state and pods"),
                         ("logs", "a process's log"), ("delete", "delete a workload (its checkpoints stay)")):
        a = wla.add_parser(action, help=text)
        if action != "list":
            a.add_argument("name", metavar="NAME")
        if action == "logs":
            a.add_argument("--process", type=int, default=0, metavar="I", help="default %(default)s")
            a.add_argument("--storage", metavar="DIR", help="--scheduler slurm: as at create (default runs)")
        a.add_argument("--namespace", default="default", help="default %(default)s")
    for a in (wc, *wla.choices.values()):
        if "--scheduler" not in a._option_string_actions:
            a.add_argument("--scheduler", choices=("kubernetes", "slurm"), default="kubernetes",
                           help="a JobSet on Kubernetes, or an sbatch job on Slurm (default %(default)s)")
    wl.set_defaults(func=cmd_workload)

    cl = sub.add_parser("cluster", help="a cluster's queueing objects (Kueue and priority classes)")
    cla = cl.add_subparsers(dest="action", required=True)
    cs = cla.add_parser(
        "setup", help="Kueue's ResourceFlavor, ClusterQueue and LocalQueue, and five PriorityClasses",
        description="Render, validate and apply (server-side) what workloads need on a cluster with Kueue "
        "and JobSet installed: a ResourceFlavor for the machine, a ClusterQueue with a quota of --nodes of them, "
        "the LocalQueue workloads name, and the PriorityClasses very-low .. very-high.")
    cs.add_argument("--hardware", default="a3mega-h100", choices=list(MACHINES), help="default %(default)s")
    cs.add_argument("--nodes", type=int, required=True, metavar="N", help="the queue's quota, in nodes")
    cs.add_argument("--queue", default="hypertron", metavar="Q", help="default %(default)s")
    cs.add_argument("--namespace", default="default", help="the LocalQueue's (default %(default)s)")
    _add_output_flags(cs, "apply")
    cl.set_defaults(func=cmd_cluster)

    mo = sub.add_parser(
        "monitor", help="goodput, badput by cause, disruptions and alarms of a training run",
        description="Report where a training run's time went, by ml-goodput-measurement's definitions, "
        "from its run directory: goodput, badput by cause, jobs, disruptions, step-time deviation, and "
        "alarms (a hung process, a NaN loss, loss spikes). Exit 1 when an alarm is raised. "
        "docs/monitoring.md defines every figure.",
    )
    mo.add_argument("run_dir", metavar="RUN_DIR")
    mo.add_argument("--json", action="store_true", help="print the report as JSON")
    mo.add_argument("--follow", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 5) until the run's job stops")
    mo.add_argument("--since", metavar="TIME", help="also report the window from TIME (ISO date-time, "
                    "Unix time, or a duration before now such as 2h)")
    mo.add_argument("--window", metavar="DURATION", help="the window's length (90s, 30m, 2h); alone: "
                    "the last DURATION")
    mo.add_argument("--hang-factor", type=float, default=10.0, metavar="K",
                    help="hung: no step for K x the ideal step time (default %(default)s)...")
    mo.add_argument("--hang-min", type=float, default=60.0, metavar="S",
                    help="...and at least S seconds (default %(default)s)")
    mo.add_argument("--straggler-threshold", type=float, default=0.75, metavar="R",
                    help="a process scoring under R is a straggler (default %(default)s)")
    mo.add_argument("--top", type=int, default=5, metavar="N",
                    help="outliers: the top N processes per metric (default %(default)s)")
    mo.add_argument("--serve", action="store_true",
                    help="serve a live dashboard of the run (one page, updated while it runs)")
    mo.add_argument("--host", default="127.0.0.1", help="--serve: the address to listen on (default %(default)s; "
                    "0.0.0.0 for every interface)")
    mo.add_argument("--port", type=int, default=8090, help="--serve: the port (default %(default)s; 0: any free one)")
    mo.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                    help="--serve: how often the page updates (default %(default)s)")
    mo.set_defaults(func=cmd_monitor)

    em = sub.add_parser("embed", help="sharded embedding tables")
    ema = em.add_subparsers(dest="action", required=True)
    ep = ema.add_parser(
        "plan", help="where each embedding table goes over the devices, and why",
        description="Place each table of a spec file (YAML: batch, tables, features; docs/embeddings.md) "
        "table-wise, row-wise or column-wise over the devices: bytes held per device, ids and bytes exchanged "
        "per step, the reason for each choice. A table's placement set in the file is kept. Exit 1 when the "
        "tables do not fit.")
    ep.add_argument("spec", metavar="SPEC.yaml")
    ep.add_argument("--hardware", default="h100", help="the device, for its memory (default %(default)s; "
                    "cpu: this host's memory shared by the devices)")
    ep.add_argument("--devices", type=int, default=None, metavar="N", help="default: one node's")
    ep.add_argument("--device-memory", type=_bytes_arg, default=None, metavar="BYTES",
                    help="memory per device for the tables (e.g. 60GB), in place of the hardware's")
    ep.add_argument("--batch", type=int, default=None, metavar="N", help="samples per step, in place of the file's")
    ep.add_argument("--json", action="store_true", help="print the plan as JSON")
    ep.set_defaults(func=cmd_embed_plan)

    k = sub.add_parser(
        "tokenize", help="pre-tokenise a corpus for data.source=tokens",
        description="Tokenise a corpus once into ArrayRecord shards of int32 ids; train on it with "
        "data.source=tokens data.paths=[OUT] and the same data.tokenizer. Never overwrites: --out "
        "must be new or an empty directory.",
    )
    k.add_argument("--source", required=True, choices=TOKENIZABLE_SOURCES)
    k.add_argument("--paths", nargs="*", default=[], metavar="PATH", help="files or directories")
    k.add_argument("--text-field", default="text", help="the text column / key (jsonl, parquet, hf)")
    k.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json (or its directory) "
                   "or a SentencePiece .model")
    k.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    k.set_defaults(func=cmd_tokenize)

    sv = sub.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint with continuous batching and a paged KV cache: POST /v1/completions, "
        "/v1/chat/completions, GET /v1/models, /health, /metrics (Prometheus). Binds 127.0.0.1 unless told.",
    )
    sv.add_argument("--config", metavar="FILE", help="a YAML file of these settings (keys as the flags, "
                    "with _ for -: max_slots: 16); flags given override it")
    _add_serve_flags(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    what = b.add_subparsers(dest="what", required=True)
    bs = what.add_parser(
        "serve", help="load-test an OpenAI-compatible completions server",
        description="Send streaming POST /v1/completions requests to any OpenAI-compatible server, "
        "at a Poisson rate (--request-rate) or a fixed number in flight (--concurrency), and report "
        "throughput and TTFT / TPOT / ITL / end-to-end latency (mean, p50, p90, p99).",
    )
    bs.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL", help="default %(default)s")
    bs.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                    help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    bs.add_argument("--model", help="default: the first id from GET /v1/models")
    bs.add_argument("--num-requests", type=int, default=100, metavar="N", help="default %(default)s")
    bs.add_argument("--request-rate", type=float, metavar="R",
                    help="Poisson arrivals, requests/s; inf = all at once (the default)")
    bs.add_argument("--concurrency", type=int, metavar="N", help="keep N requests in flight instead")
    bs.add_argument("--prompts", metavar="FILE", help='JSONL: {"prompt": str or [token ids], '
                    '"max_tokens"?: int} per line, cycled (default: random token-id prompts)')
    bs.add_argument("--random-input-len", type=int, metavar="L", help="random prompt length (default 128)")
    bs.add_argument("--random-vocab-low", type=int, default=3, metavar="ID", help="default %(default)s")
    bs.add_argument("--random-vocab-high", type=int, default=259, metavar="ID", help="exclusive, default %(default)s")
    bs.add_argument("--max-tokens", type=int, default=128, metavar="M",
                    help="per request, unless its prompts line says (default %(default)s)")
    bs.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default 0 (greedy)")
    bs.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (an extension)')
    bs.add_argument("--seed", type=int, default=0, metavar="S", help="for the arrival times and random prompts")
    bs.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                    help="seconds to connect, or between two reads of a stream (default %(default)s)")
    bs.add_argument("--output", metavar="FILE", help="write the report as JSON")
    bs.set_defaults(func=cmd_bench_serve)
    return p


def _leave_distributed_job(code: int) -> None:
    """In a multi-process job, exit at once: Python's normal exit would wait in JAX's shutdown
    barrier for the other processes (minutes), then abort with a C++ trace."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (argparse takes a positional list only in one piece)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "command", None) == "convert" and args.from_hf and not args.out:
        print("error: convert --from-hf needs --out DIR", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        _leave_distributed_job(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
