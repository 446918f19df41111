"""``hypertron launch``, ``recipes``, ``workload`` and ``cluster``: running training on processes,
Kubernetes and Slurm."""

from __future__ import annotations

import argparse
import os
import sys

from hypertron.errors import UserError


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
    from hypertron.units import describe_bytes

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
                      describe_bytes(p.memory.total), describe_bytes(p.device_memory) if p.device_memory else "?",
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
        from hypertron.units import describe_bytes

        raise UserError(f"recipe {recipe.name} on {recipe.nodes} nodes needs {describe_bytes(p.memory.total)} per "
                        f"device, more than the {describe_bytes(p.device_memory)} of a {p.hardware.name} "
                        f"(hypertron recipes "
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


def _add_output_flags(parser: argparse.ArgumentParser, verb: str) -> None:
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--dry-run", action="store_true", help=f"print the objects; {verb} nothing")
    out.add_argument("--output", metavar="FILE", help=f"write the objects to a new FILE; {verb} nothing")
