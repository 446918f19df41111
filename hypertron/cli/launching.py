"""``hypertron launch``, ``recipes``, ``workload`` and ``cluster``: running training on processes,
Kubernetes and Slurm."""

from __future__ import annotations

import argparse
import os
import sys

from hypertron.cli.flags import add_command, add_command_group, add_json_flag, add_output_flags, number_arg
from hypertron.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``launch local``, ``recipes``, ``workload ...`` and ``cluster setup`` to ``sub``."""
    for add in (_add_launch, _add_recipes, _add_workload, _add_cluster):
        add(sub)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    where = add_command_group(sub, "launch", help="run a command as several cooperating processes", dest="where")
    lo = add_command(where, "local", cmd_launch, help="N processes on this machine (jax.distributed over 127.0.0.1)")
    lo.add_argument("--processes", type=number_arg(int), metavar="N")
    lo.add_argument("--recipe", metavar="R", help="train this recipe as its processes (nodes x processes per node), "
                    "with its environment; key=value overrides may follow")
    lo.add_argument("--gpus", metavar="N_OR_LIST", help="split these GPUs (a count or 0,1,2,3) over the processes, "
                    "each its own CUDA_VISIBLE_DEVICES slice (default: the launcher's CUDA_VISIBLE_DEVICES)")
    lo.add_argument("--cpu-devices", type=number_arg(int), default=None, metavar="K",
                    help="run on the CPU with K simulated devices per process")
    lo.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def _add_recipes(sub: argparse._SubParsersAction) -> None:
    rc = add_command(sub, "recipes", cmd_recipes,
                     help="the recipes per model x machine, with their predicted memory per device")
    rc.add_argument("name", nargs="?", metavar="NAME", help="one recipe, e.g. a3mega-h100/llama3.1-70b")
    rc.add_argument("--nodes", type=number_arg(int), default=None, metavar="N",
                    help="on N nodes (default: each recipe's own)")
    add_json_flag(rc)
    rc.add_argument("--config", action="store_true", help="with NAME: also print the resolved config as YAML")


def _add_workload(sub: argparse._SubParsersAction) -> None:
    wla = add_command_group(
        sub, "workload", help="training workloads on Kubernetes (JobSet + Kueue) or Slurm (sbatch)", func=cmd_workload)
    _add_workload_create(wla)
    for action, text in (("list", "hypertron's workloads and their state"), ("describe", "a workload's state and pods"),
                         ("logs", "a process's log"), ("delete", "delete a workload (its checkpoints stay)")):
        a = wla.add_parser(action, help=text)
        if action != "list":
            a.add_argument("name", metavar="NAME")
        if action == "logs":
            a.add_argument("--process", type=number_arg(int), default=0, metavar="I", help="default %(default)s")
            a.add_argument("--storage", metavar="DIR", help="--scheduler slurm: as at create (default runs)")
        _add_namespace(a)
    for a in wla.choices.values():
        a.add_argument("--scheduler", choices=("kubernetes", "slurm"), default="kubernetes",
                       help="a JobSet on Kubernetes, or an sbatch job on Slurm (default %(default)s)")


def _add_namespace(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """``--namespace``, the Kubernetes namespace (default ``default``) of the objects or of ``whose``."""
    parser.add_argument("--namespace", default="default",
                        help=f"{whose} (default %(default)s)" if whose else "default %(default)s")


def _add_workload_create(wla: argparse._SubParsersAction) -> None:
    from hypertron.launch.machines import PRIORITIES

    wc = wla.add_parser(
        "create", help="render, validate and submit a recipe as a JobSet",
        description="Render a recipe as a ConfigMap (the resolved recipe) and a JobSet of one pod per node, "
        "validate both strictly, print them, and submit them (or only print them with --dry-run, or write them "
        "with --output). key=value overrides after the options change the recipe. docs/launch.md shows the objects.")
    wc.add_argument("name", metavar="NAME", help="the workload's name (a DNS label; its pods' host names must "
                    "stay within 57 characters)")
    wc.add_argument("--recipe", required=True, metavar="R",
                    help="a recipe name (a3mega-h100/llama3.1-70b) or YAML file")
    wc.add_argument("--nodes", type=number_arg(int), default=None, metavar="N", help="default: the recipe's")
    wc.add_argument("--image", metavar="IMG", help="the container image with hypertron installed "
                    "(default: $HYPERTRON_IMAGE)")
    wc.add_argument("--priority", default="medium", metavar="P",
                    help=f"{', '.join(PRIORITIES)} (default %(default)s)")
    wc.add_argument("--max-restarts", type=number_arg(int), default=10, metavar="K",
                    help="gang restarts before the workload fails; each preemption or eviction uses one "
                    "(default %(default)s)")
    wc.add_argument("--queue", default="hypertron", metavar="Q", help="the Kueue LocalQueue (default %(default)s)")
    wc.add_argument("--storage", metavar="WHERE", help="where the run directory lives: pvc:CLAIM or gs://BUCKET; "
                    "with --scheduler slurm, a directory on the shared file system (default runs)")
    wc.add_argument("--partition", metavar="P", help="--scheduler slurm: the partition (default: the cluster's)")
    wc.add_argument("--time", metavar="T", help="--scheduler slurm: the time limit (minutes, HH:MM:SS, D-HH:MM)")
    _add_namespace(wc)
    add_output_flags(wc, "submit")
    wc.add_argument("overrides", nargs="*", metavar="key=value")


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    from hypertron.launch.machines import MACHINES

    cla = add_command_group(
        sub, "cluster", help="a GKE cluster of TPU slices (create, delete, list) and its queueing objects (setup)",
        func=cmd_cluster)
    cs = cla.add_parser(
        "setup", help="Kueue's ResourceFlavor, ClusterQueue and LocalQueue, and five PriorityClasses",
        description="Render, validate and apply (server-side) what workloads need on a cluster with Kueue "
        "and JobSet installed: a ResourceFlavor for the machine, a ClusterQueue with a quota of --nodes of them, "
        "the LocalQueue workloads name, and the PriorityClasses very-low .. very-high.")
    cs.add_argument("--machine", default="a3mega-h100", choices=list(MACHINES), help="default %(default)s")
    cs.renamed["--hardware"] = ("cluster setup --hardware is now --machine (a machine from the table: "
                                f"{', '.join(MACHINES)}; plan's --hardware is the accelerator)")
    cs.add_argument("--nodes", type=number_arg(int), required=True, metavar="N", help="the queue's quota, in nodes")
    cs.add_argument("--queue", default="hypertron", metavar="Q", help="default %(default)s")
    _add_namespace(cs, "the LocalQueue's")
    add_output_flags(cs, "apply")
    _add_gke(cla)


def _add_gke(cla) -> None:
    """``cluster create | delete | list``: a GKE cluster of TPU slices, with XPK's flag names."""
    from hypertron.launch.machines import TPU_SLICES

    def where(p, verb: str) -> None:
        p.add_argument("--project", required=True, metavar="P", help="the Google Cloud project")
        p.add_argument("--zone", required=True, metavar="Z", help="its zone (the cluster is regional: the zone's region)")
        p.add_argument("--dry-run", action="store_true", help=f"print the commands, one a line; {verb} nothing")

    cc = cla.add_parser(
        "create", help="a GKE cluster of TPU slices, with JobSet, Kueue and cluster setup's queue (XPK's commands)",
        description="Run (or with --dry-run print) the gcloud and kubectl commands XPK 1.16 runs for the same "
        "arguments: the cluster and its CPU pool, a node pool of each slice, the credentials, JobSet's and "
        "Kueue's releases, then cluster setup's objects for every chip. Needs gcloud and kubectl on PATH; stops "
        "at the first command that fails. GPU clusters come from Cluster Toolkit's blueprints.")
    cc.add_argument("name", metavar="NAME", help="the cluster's name")
    where(cc, "create")
    cc.add_argument("--tpu-type", required=True, metavar="T", help=f"the slice type: {', '.join(TPU_SLICES)}")
    cc.add_argument("--num-slices", type=number_arg(int), default=1, metavar="N", help="default %(default)s")
    capacity = cc.add_mutually_exclusive_group()
    capacity.add_argument("--spot", action="store_true", help="spot VMs")
    capacity.add_argument("--on-demand", action="store_true", help="on-demand VMs (the default)")
    capacity.add_argument("--reservation", metavar="R", help="VMs of the reservation R")
    cc.add_argument("--default-pool-cpu-machine-type", default="e2-standard-16", metavar="M", help="default %(default)s")
    cc.add_argument("--default-pool-cpu-num-nodes", type=number_arg(int), default=6, metavar="N",
                    help="default %(default)s")
    cc.add_argument("--queue", default="hypertron", metavar="Q", help="cluster setup's queue; default %(default)s")
    cd = cla.add_parser("delete", help="delete a GKE cluster (gcloud, as XPK deletes it)")
    cd.add_argument("name", metavar="NAME", help="the cluster's name")
    where(cd, "delete")
    where(cla.add_parser("list", help="the GKE clusters of a project in a zone's region"), "list")


def cmd_launch(args: argparse.Namespace) -> int:
    """Start N processes of `hypertron COMMAND...` on this machine, joined by jax.distributed, e.g. `hypertron
    launch local --processes 2 --cpu-devices 4 -- train model=tiny`."""
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
    """List the recipes (recipes/<machine>/<model>.yaml) with their machine, node count, mesh and the memory
    model's prediction per device; with a NAME, its XLA flags and environment with their reasons and its whole
    plan."""
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
    for col in ("recipe", "nodes", "devices", "mesh", "batch x seq", "memory per device", "of", "fits", "step", "MFU"):
        table.add_column(col, justify="left" if col in ("recipe", "mesh", "batch x seq", "fits") else "right",
                         no_wrap=True)
    for r, p in rows:
        mesh = " x ".join(f"{a} {n}" for a, n in r.mesh.items() if n > 1) or "1 device"
        step = p.predict()  # the planner's prediction (docs/memory.md, "Held to published results")
        table.add_row(r.name, str(r.nodes), str(r.devices), mesh, f"{r.cfg.train.global_batch} x {r.cfg.train.seq_len}",
                      describe_bytes(p.memory.total), describe_bytes(p.device_memory) if p.device_memory else "?",
                      {True: "yes", False: "NO", None: "?"}[p.fits], "-" if step is None else f"{step:.2f} s",
                      "-" if step is None else f"{100 * p.compute / step:.0f}%")
    console = Console()
    console.width = max(console.width, 140)
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
    from hypertron.launch import cluster, k8s, validate

    if args.scheduler == "slurm":
        return _slurm_workload(args)
    validate.dns_label(args.namespace, "--namespace")
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
    from hypertron.launch import gke, k8s, machines

    if args.action == "setup":
        objects = k8s.cluster_objects(machines.machine(args.machine), args.nodes, args.queue, args.namespace)
        return _render_or_apply(objects, args, "applied", create_only=False)
    if args.action == "create":
        capacity = "spot" if args.spot else "reservation" if args.reservation is not None else "on-demand"
        spec = gke.ClusterSpec(args.name, args.project, args.zone, args.tpu_type, args.num_slices, capacity,
                               args.reservation or "", args.default_pool_cpu_machine_type,
                               args.default_pool_cpu_num_nodes)
        slice_ = gke.check(spec)
        nodes = spec.num_slices * slice_.vms
        objects = k8s.cluster_objects(machines.MACHINES[slice_.machine], nodes, args.queue,
                                      per_node=slice_.chips // slice_.vms)
        setup = f"hypertron cluster setup --machine {slice_.machine} --nodes {nodes} --queue {args.queue} --dry-run"
        commands = gke.create_commands(spec, k8s.to_yaml(objects), setup)
    elif args.action == "delete":
        commands = gke.delete_commands(args.name, args.project, args.zone)
    else:
        commands = gke.list_commands(args.project, args.zone)
    if args.dry_run:
        print("\n".join(c.line() for c in commands))
        return 0
    gke.run(commands, f"cluster {args.action}")
    return 0
