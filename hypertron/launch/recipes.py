"""Recipes: ``recipes/<machine>/<model>.yaml``, a training config tuned for one machine, with the
XLA flags and environment it runs under (``launch:``) and a default node count.

A recipe is named by its path under the recipes folder without ``.yaml``
(``a3mega-h100/llama3.1-70b``) or by a path to any YAML file. The folder is ``$HYPERTRON_RECIPES``
when set, else the ``recipes`` folder of this checkout. :func:`load` resolves a recipe for a node
count before anything else happens: the mesh, the batch over the processes and the memory model's
prediction per device, all from abstract shapes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from hypertron.config import Config, ConfigError, dump_yaml, load_config
from hypertron.config.numbers import check_number
from hypertron.config.validation import check_mesh
from hypertron.errors import UserError
from hypertron.launch.machines import Machine, machine
from hypertron.models.plan import Plan, plan

_CPU_DEVICES = re.compile(r"^--xla_force_host_platform_device_count=(\d+)$")


def root() -> Path:
    env = os.environ.get("HYPERTRON_RECIPES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "recipes"


def names() -> list[str]:
    """Every recipe under :func:`root` written for a machine (``<machine>/<model>``), sorted. A
    recommender's (``task: dlrm``) is left out: it trains in one process, so there is nothing to
    launch across nodes (``hypertron train RECIPE`` runs it)."""
    base = root()
    return sorted(str(p.relative_to(base).with_suffix("")) for p in base.glob("*/*.yaml")
                  if _task(p) == "lm")


def _task(path: Path) -> str:
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return "lm"  # load() reports the problem
    return str(loaded.get("task", "lm")) if isinstance(loaded, dict) else "lm"


def path_of(name: str) -> Path:
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml") and as_path.is_file():
        return as_path
    found = root() / f"{name}.yaml"
    if found.is_file():
        return found
    known = names()
    raise UserError(f"unknown recipe {name!r}: " + (f"one of {', '.join(known)}, or a YAML file" if known
                                                      else f"no recipes under {root()} and no such YAML file"))


# The exit code of a run stopped by SIGTERM under a scheduler (train.preempt_exit_code): a
# Kubernetes workload's restart set holds it, and a Slurm job requeues itself on it.
PREEMPT_EXIT_CODE = 42


@dataclass(frozen=True)
class Recipe:
    name: str
    cfg: Config               # with launch.nodes the node count asked for
    machine: Machine
    devices_per_process: int
    mesh: dict[str, int]      # resolved over every device

    @property
    def nodes(self) -> int:
        return self.cfg.launch.nodes

    @property
    def processes_per_node(self) -> int:
        return self.cfg.launch.processes_per_node

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices_per_node(self) -> int:
        return self.processes_per_node * self.devices_per_process

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def devices_per_granule(self) -> int:
        """The devices the across-node (dcn) axes step over: a node's, or a TPU slice's."""
        return self.devices // self.cfg.launch.slices if self.machine.tpus else self.devices_per_node

    def run_config(self, run_dir: str, rendered_by: str) -> str:
        """The recipe as a scheduler's processes run it: resolved, in ``run_dir``, and SIGTERM's
        exit code :data:`PREEMPT_EXIT_CODE`, so that a preempted run is restarted, not counted done."""
        cfg = replace(self.cfg, run_dir=run_dir, train=replace(self.cfg.train, preempt_exit_code=PREEMPT_EXIT_CODE))
        return f"# {self.name} on {self.nodes} node{'s' * (self.nodes > 1)}, rendered by {rendered_by}\n" \
            + dump_yaml(cfg)

    def xla_flags(self) -> str:
        return " ".join(s.value for s in self.cfg.launch.xla_flags)

    def env(self) -> dict[str, str]:
        """The recipe's environment, its XLA flags included: ``XLA_FLAGS``, or on a TPU machine
        ``LIBTPU_INIT_ARGS`` (the TPU compiler lives in libtpu and reads its flags there)."""
        out = dict(s.value.split("=", 1) for s in self.cfg.launch.env)
        if self.cfg.launch.xla_flags:
            out["LIBTPU_INIT_ARGS" if self.machine.tpus else "XLA_FLAGS"] = self.xla_flags()
        return out

    def predict(self) -> Plan:
        """The memory model's plan for this recipe on its nodes, against the share of each device
        that ``XLA_PYTHON_CLIENT_MEM_FRACTION`` leaves JAX when the recipe sets it."""
        p = plan(self.cfg, self.machine.device, self.devices, self.devices_per_granule)
        fraction = self.env().get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        if fraction and p.device_memory is not None:
            share, reason = check_number(fraction, float, above=0, high=1)
            if share is None:
                raise UserError(f"recipe {self.name}: XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}: {reason}")
            p = replace(p, device_memory=p.device_memory * share)
            p.notes.append(f"device memory: {share:g} of each device's (XLA_PYTHON_CLIENT_MEM_FRACTION)")
        return p


def _tpu_nodes(name: str, cfg: Config, nodes: int | None) -> Config:
    """A TPU recipe's nodes: its slices' VMs (``launch.tpu_type`` x ``launch.slices``)."""
    from hypertron.launch.machines import tpu_slice

    t = cfg.launch
    if nodes is not None:
        raise UserError(f"recipe {name}: a TPU recipe's nodes are its slices' VMs; give launch.slices=N, not --nodes")
    if not t.tpu_type:
        raise UserError(f"recipe {name}: launch.machine={t.machine} needs launch.tpu_type (a slice type, e.g. v5p-128)")
    slice_ = tpu_slice(t.tpu_type)
    if slice_.machine != t.machine:
        raise UserError(f"recipe {name}: launch.tpu_type={t.tpu_type} is a {slice_.machine} slice, not {t.machine}'s")
    if t.slices < 1:
        raise UserError(f"recipe {name}: launch.slices={t.slices}: must be at least 1")
    if t.processes_per_node != 1:
        raise UserError(f"recipe {name}: launch.processes_per_node={t.processes_per_node}: a TPU VM runs one process")
    return replace(cfg, launch=replace(t, nodes=t.slices * slice_.vms))


def devices_per_process(cfg: Config, m: Machine) -> int:
    """A GPU machine's GPUs over its processes; on the CPU, the simulated devices the recipe's XLA
    flags ask for."""
    if m.tpus:  # a VM's chips: 4, or a single-chip slice's 1
        from hypertron.launch.machines import tpu_slice

        slice_ = tpu_slice(cfg.launch.tpu_type)
        return slice_.chips // slice_.vms
    if m.gpus:
        per_node = cfg.launch.processes_per_node
        if m.gpus % per_node:
            raise UserError(f"launch.processes_per_node={per_node} does not divide the {m.gpus} GPUs of a {m.name} node")
        return m.gpus // per_node
    forced = [int(g.group(1)) for s in cfg.launch.xla_flags if (g := _CPU_DEVICES.match(s.value))]
    return forced[-1] if forced else 1


def load(name: str, nodes: int | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The recipe ``name`` on ``nodes`` nodes (default: its own), checked for them: one clear line
    when the mesh cannot use that many devices or the batch does not split over them."""
    path = path_of(name)
    cfg = load_config(path, list(overrides))
    if not cfg.launch.machine:
        raise UserError(f"recipe {name}: no launch.machine, so no machine to run on (recipes/<machine>/ have one)")
    m = machine(cfg.launch.machine)
    if m.tpus:
        cfg = _tpu_nodes(name, cfg, nodes)
        nodes = None
    if nodes is not None:
        if nodes < 1:
            raise UserError(f"--nodes={nodes}: must be at least 1")
        cfg = replace(cfg, launch=replace(cfg.launch, nodes=nodes))
    per_process = devices_per_process(cfg, m)
    n, processes = cfg.launch.nodes, cfg.launch.nodes * cfg.launch.processes_per_node
    # The across-node (dcn) axes span what is joined by the data-center network: the processes, or
    # on TPUs the slices (a slice's VMs share its ICI).
    granules = cfg.launch.slices if m.tpus else processes
    try:
        mesh = check_mesh(cfg, processes * per_process, processes, per_process, granules)
    except ConfigError as e:
        raise UserError(f"recipe {name} on {n} node{'s' * (n > 1)} ({processes * per_process} devices): {e}") from None
    return Recipe(name, cfg, m, per_process, mesh)
