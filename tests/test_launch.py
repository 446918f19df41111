"""Recipes and Kubernetes workloads: every recipe resolves and fits, its XLA flags are XLA's, the
rendered objects equal their golden files and pass strict validation, the validators catch what
they must, bad input is one line, and two processes started with exactly the environment pods 0
and 1 would get form one job, train, and exit with the workload's code on SIGTERM.

Golden files: ``HYPERTRON_UPDATE_GOLDEN=1 pytest tests/test_launch.py`` rewrites them (read the diff).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hypertron import cli
from hypertron.config import load_config
from hypertron.config.validation import check_devices
from hypertron.errors import UserError
from hypertron.launch.local import free_ports
from hypertron.launch import k8s, machines, recipes, validate
from hypertron.train.events import read_events
from support import processes  # tests/support
from support.cli import one_error_line, run_cli
from support.tiny import TWO_LAYERS  # tests/support

GOLDEN = Path(__file__).parent / "golden" / "launch"
IMAGE = "us-docker.pkg.dev/my-project/hypertron:0.1.0"
REQUIRED = {"a3mega-h100/llama2-7b", "a3mega-h100/llama2-70b", "a3mega-h100/llama3.1-8b",
            "a3mega-h100/llama3.1-70b", "a3mega-h100/mixtral-8x7b", "a3ultra-h200/llama3.1-70b", "cpu/tiny",
            "tpu-v5p/llama3.1-70b", "tpu-v5p/mixtral-8x7b", "tpu-v6e/llama3.1-70b", "tpu-v6e/llama3.1-8b",
            "tpu-v5e/llama3.1-8b"}


def test_every_recipe_resolves_for_its_devices_and_fits_its_hardware():
    assert REQUIRED <= set(recipes.names())
    for name in recipes.names():
        r = recipes.load(name)
        assert r.machine.name == name.split("/")[0] == r.cfg.launch.machine, name
        assert r.cfg.model.name == load_config(None, [f"model={name.split('/')[1]}"]).model.name or name == "cpu/tiny"
        size = 1
        for n in r.mesh.values():
            size *= n
        assert size == r.devices == r.nodes * r.devices_per_node, (name, r.mesh)
        if r.machine.gpus:  # across-node axes: the mesh splits over the nodes
            assert r.cfg.mesh.dcn.hybrid and r.cfg.launch.xla_flags and r.cfg.launch.env, name
            assert all(s.reason for s in (*r.cfg.launch.xla_flags, *r.cfg.launch.env)), name
        p = r.predict()  # abstract shapes: nothing is allocated
        assert p.fits is True, (name, p.memory.total, p.device_memory)
        if r.machine.tpus:  # a slice's VMs; the dcn axes span the slices; libtpu reads the flags
            slice_ = machines.tpu_slice(r.cfg.launch.tpu_type)
            assert r.nodes == r.cfg.launch.slices * slice_.vms and slice_.machine == r.machine.name, name
            assert set(r.env()) >= {"LIBTPU_INIT_ARGS"} and "XLA_FLAGS" not in r.env(), name
            assert all(s.reason for s in r.cfg.launch.xla_flags), name
        if name.startswith("a3mega-h100/"):  # what GPUDirect-TCPXO needs is in every A3 Mega recipe
            env = r.env()
            assert env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices", name
            assert env["NCCL_FASTRAK_IFNAME"].split(",") == [f"eth{i}" for i in range(1, 9)], name


def _xla_accepts(flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return processes.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          text=True, timeout=120)


def test_each_recipes_xla_flags_are_accepted_by_xla():
    flag_sets = {r.xla_flags() for r in map(recipes.load, recipes.names()) if not r.machine.tpus}  # libtpu's: not here
    assert len(flag_sets) >= 3
    for flags in sorted(flag_sets):
        r = _xla_accepts(flags)
        assert r.returncode == 0, (flags, r.stderr[-2000:])
    # The check has teeth: XLA aborts on a flag it does not know.
    r = _xla_accepts("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_no_such_flag=true")
    assert r.returncode != 0 and "--xla_gpu_no_such_flag" in r.stderr


def _workload(recipe: str, name: str = "llama70", nodes: int | None = None, **kw) -> k8s.Workload:
    options = dict(image=IMAGE, storage="gs://my-runs", priority="high", max_restarts=5) | kw
    return k8s.Workload(name, recipes.load(recipe, nodes), **options)


CASES = {  # golden file: (objects, the command line that prints them)
    "llama3.1-70b-a3mega.yaml": (lambda: k8s.workload_objects(_workload("a3mega-h100/llama3.1-70b")),
                                 ["workload", "create", "llama70", "--recipe", "a3mega-h100/llama3.1-70b",
                                  "--image", IMAGE, "--storage", "gs://my-runs", "--priority", "high",
                                  "--max-restarts", "5"]),
    "tiny-cpu.yaml": (lambda: k8s.workload_objects(_workload("cpu/tiny", "tiny", storage="pvc:runs", priority="low",
                                                             max_restarts=2, queue="cpu-queue")),
                      ["workload", "create", "tiny", "--recipe", "cpu/tiny", "--image", IMAGE, "--storage", "pvc:runs",
                       "--priority", "low", "--max-restarts", "2", "--queue", "cpu-queue"]),
    "llama3.1-70b-tpu-v5p.yaml": (lambda: k8s.workload_objects(_workload("tpu-v5p/llama3.1-70b")),
                                  ["workload", "create", "llama70", "--recipe", "tpu-v5p/llama3.1-70b",
                                   "--image", IMAGE, "--storage", "gs://my-runs", "--priority", "high",
                                   "--max-restarts", "5"]),
    "cluster-a3mega.yaml": (lambda: k8s.cluster_objects(machines.machine("a3mega-h100"), 32),
                            ["cluster", "setup", "--machine", "a3mega-h100", "--nodes", "32"]),
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_rendered_objects_equal_their_golden_files_and_pass_strict_validation(golden, capsys):
    build, argv = CASES[golden]
    objects = build()
    validate.check(objects)  # kubernetes-validate strict, the JobSet's typed round trip, Kueue's fields
    text = k8s.to_yaml(objects)
    path = GOLDEN / golden
    if os.environ.get("HYPERTRON_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{golden} changed: HYPERTRON_UPDATE_GOLDEN=1 rewrites it; read the diff"
    assert list(yaml.safe_load_all(text)) == objects  # the YAML reads back as the objects
    # The command prints exactly these objects, and applies nothing with --dry-run.
    assert cli.main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out == text
    for js in (o for o in objects if o["kind"] == "JobSet"):
        nodes = js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"]
        name = js["metadata"]["name"]
        env = k8s.pod_environment(js, nodes - 1, job=js["spec"]["replicatedJobs"][0]["replicas"] - 1)
        if "tpu" in golden:
            _check_tpu_jobset(js, env)
        else:
            assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-workers-0-0.{name}:{k8s.PORT}"
            assert env["JAX_NUM_PROCESSES"] == str(nodes) and env["JAX_PROCESS_ID"] == str(nodes - 1)
        (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
        run = yaml.safe_load(cm["data"]["recipe.yaml"])
        assert run["run_dir"] == f"/mnt/run/{name}" and run["train"]["preempt_exit_code"] == k8s.PREEMPT_EXIT_CODE
        rules = js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
        assert k8s.PREEMPT_EXIT_CODE in rules[0]["onExitCodes"]["values"] and 2 not in rules[0]["onExitCodes"]["values"]


def _check_tpu_jobset(js: dict, env: dict) -> None:
    """XPK's shape for 2 slices of v5p-128 (``xpk workload create --tpu-type=v5p-128 --num-slices=2``):
    the job ``slice-job``, a replica a slice of a pod a VM, the slice's node pool by accelerator and
    topology, 4 chips a pod, one slice a node pool, the host's network and ports, the TPU taint; the
    multislice variables from the JobSet's own fields (this pod: the last slice's last VM)."""
    name, (job,) = js["metadata"]["name"], js["spec"]["replicatedJobs"]
    assert (job["name"], job["replicas"], job["template"]["spec"]["parallelism"]) == ("slice-job", 2, 16)
    assert js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    (c,) = pod["containers"]
    assert c["resources"] == {"limits": {"google.com/tpu": "4"}} and c["securityContext"] == {"privileged": True}
    assert sorted(p["containerPort"] for p in c["ports"]) == [8080, 8471]
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{name}-slice-job-0-0.{name}"
    assert (env["MEGASCALE_NUM_SLICES"], env["MEGASCALE_SLICE_ID"], env["MEGASCALE_PORT"]) == ("2", "1", "8080")
    assert "--xla_tpu_enable_data_parallel_all_reduce_opt=true" in env["LIBTPU_INIT_ARGS"] and "XLA_FLAGS" not in env
    assert not any(k.startswith("JAX_") for k in env)  # JAX finds a GKE slice's processes itself


def test_tpu_recipes_are_refused_in_one_line_where_they_do_not_fit_their_machine(tmp_path):
    text = recipes.path_of("tpu-v5p/llama3.1-70b").read_text()
    for old, new, message in [("tpu_type: v5p-128", "tpu_type: v6e-256", "is a tpu-v6e slice, not tpu-v5p's"),
                              ("tpu_type: v5p-128", "tpu_type: v5p-100", "--tpu-type=v5p-100: not a TPU type"),
                              ("  slices: 2", "  slices: 0", "launch.slices=0: must be at least 1")]:
        mine = tmp_path / "mine.yaml"
        mine.write_text(text.replace(old, new))
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            recipes.load(str(mine))
    with pytest.raises(UserError, match="a TPU recipe's nodes are its slices' VMs; give launch.slices=N"):
        recipes.load("tpu-v5p/llama3.1-70b", nodes=4)
    # On 4 slices the dcn axis spans the slices, each slice's 64 chips the fsdp axis; train's own check
    # of the devices (32 VM processes of 4 chips, 4 slices) gives the same mesh.
    r = recipes.load("tpu-v5p/llama3.1-70b", overrides=["launch.slices=4", "train.global_batch=512"])
    assert r.mesh == {"data": 4, "fsdp": 64, "expert": 1, "context": 1, "tensor": 1, "stage": 1}
    assert check_devices(r.cfg, 256, 64, 4, "tpu", granules=4) == r.mesh


def _broken(mutate):
    objects = k8s.workload_objects(_workload("cpu/tiny", "tiny", storage="pvc:runs"))
    objects = copy.deepcopy(objects)
    mutate({o["kind"]: o for o in objects})
    with pytest.raises(UserError) as e:
        validate.check(objects)
    return str(e.value)


def _pod(o):
    return o["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_the_validators_refuse_what_the_api_server_would_drop_or_reject():
    # An unknown field in the pod spec: the typed models drop it, so the round trip catches it.
    msg = _broken(lambda o: _pod(o).update(restartPolicyy="Never"))
    assert "restartPolicyy" in msg and "JobSet tiny" in msg
    # An unknown field of the JobSet itself.
    assert "failurePolicyy" in _broken(lambda o: o["JobSet"]["spec"].update(failurePolicyy={}))
    # A failure-policy action JobSet does not have (the models take any string).
    msg = _broken(lambda o: o["JobSet"]["spec"]["failurePolicy"]["rules"][0].update(action="FailJobset"))
    assert "FailJobset" in msg and "FailJobSet" in msg
    # A rule name JobSet's webhook refuses (no '-').
    assert "no-restart" in _broken(lambda o: o["JobSet"]["spec"]["failurePolicy"]["rules"][0].update(name="no-restart"))
    # A wrong type in the container (an integer where Kubernetes wants a string).
    msg = _broken(lambda o: _pod(o)["containers"][0]["env"].append({"name": "X", "value": 5}))
    assert "JobSet tiny" in msg and "env" in msg
    # A ConfigMap with a field Kubernetes does not have: strict mode.
    msg = _broken(lambda o: o["ConfigMap"].update(spec={}))
    assert "ConfigMap tiny-recipe" in msg and "spec" in msg
    # Kueue: a misspelt field, and an unknown preemption policy.
    cq = k8s.cluster_objects(machines.machine("cpu"), 2)[1]
    bad = copy.deepcopy(cq)
    bad["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuta"] = 2
    with pytest.raises(UserError, match="nominalQuta"):
        validate.check([bad])
    bad = copy.deepcopy(cq)
    bad["spec"]["preemption"]["withinClusterQueue"] = "Lower"
    with pytest.raises(UserError, match="withinClusterQueue"):
        validate.check([bad])


@pytest.mark.parametrize("argv,message", [
    (["workload", "create", "w", "--recipe", "a3mega-h100/llama9-7b"], "unknown recipe 'a3mega-h100/llama9-7b'"),
    (["workload", "create", "w", "--recipe", "cpu/tiny", "--nodes", "3"],
     "recipe cpu/tiny on 3 nodes (6 devices): train.global_batch=8"),
    # 46 + "-workers-0-1" is 58: JobSet refuses it (its pods' names add 6), though a DNS label allows 63
    (["workload", "create", "w" * 46, "--recipe", "cpu/tiny"], "must be at most 57; use at most 45 characters"),
    (["workload", "create", "w", "--recipe", "cpu/tiny", "--priority", "urgent"], "--priority='urgent'"),
    (["workload", "create", "w", "--recipe", "cpu/tiny", "--storage", "/local/disk"], "--storage='/local/disk'"),
    (["workload", "create", "w", "--recipe", "a3mega-h100/llama3.1-70b", "--nodes", "2"],
     "more than the 67.1 GiB of a h100"),
    (["workload", "create", "w", "--recipe", "cpu/tiny"], "no kubeconfig"),  # a real apply
    (["workload", "list"], "no kubeconfig"),
    (["cluster", "setup", "--nodes", "4"], "no kubeconfig"),
    (["recipes", "cpu/nothing"], "unknown recipe 'cpu/nothing'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_applied(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if argv[:2] == ["workload", "create"] and "--storage" not in argv:
        argv = [*argv, "--storage", "pvc:runs", "--image", IMAGE]
    elif argv[:2] == ["workload", "create"]:
        argv = [*argv, "--image", IMAGE]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_recipe_names_its_machine_in_launch_machine(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text(recipes.path_of("cpu/tiny").read_text())
    r = recipes.load(str(mine))
    assert r.cfg.launch.machine == "cpu" and r.machine is machines.MACHINES["cpu"]
    shown = run_cli(["recipes", str(mine), "--json"])
    assert shown.rc == 0 and json.loads(shown.stdout)["machine"] == "cpu", shown.describe()


def test_the_old_spellings_of_a_machine_are_one_line_naming_the_new_one(tmp_path):
    """``launch.hardware`` (in a recipe or an override) and ``cluster setup --hardware`` were the
    machine; now ``--hardware`` is only plan's accelerator."""
    old = tmp_path / "old.yaml"
    old.write_text(recipes.path_of("cpu/tiny").read_text().replace("\n  machine: cpu\n", "\n  hardware: cpu\n"))
    create = ["workload", "create", "w", "--recipe", "cpu/tiny", "--storage", "pvc:runs", "--image", IMAGE, "--dry-run"]
    for argv in (["recipes", str(old)], [*create, "launch.hardware=cpu"]):
        line = one_error_line(run_cli(argv), "launch.hardware is now launch.machine")
        assert line.startswith("error: launch.hardware is now launch.machine ("), line
    # the flag, before argparse's own checks (the second leaves out the required --nodes)
    for argv in (["cluster", "setup", "--hardware", "cpu", "--nodes", "2", "--dry-run"],
                 ["cluster", "setup", "--hardware=cpu"]):
        one_error_line(run_cli(argv), "cluster setup --hardware is now --machine", ", ".join(machines.MACHINES))
    # an unknown machine lists the table's
    one_error_line(run_cli([*create, "launch.machine=tpu"]), "launch.machine='tpu'", ", ".join(machines.MACHINES))


def test_output_writes_a_new_file_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "objects.yaml"
    argv = ["cluster", "setup", "--machine", "cpu", "--nodes", "2", "--output", str(out)]
    assert cli.main(argv) == 0
    text = out.read_text()
    assert [o["kind"] for o in yaml.safe_load_all(text)] == ["ResourceFlavor", "ClusterQueue", "LocalQueue"] + [
        "PriorityClass"] * 5
    assert cli.main(argv) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == text


@pytest.mark.slow
def test_two_processes_with_the_pods_environment_form_one_job_train_and_exit_42_on_sigterm(tmp_path):
    """Pods 0 and 1 of the cpu/tiny workload, as local processes: the recipe from the ConfigMap,
    the environment from the JobSet as the kubelet would set it. Replaced for loopback: the
    coordinator's host name by 127.0.0.1 (and its port by a free one), the run directory by a temp
    one; added: the coordinator binds to 127.0.0.1 only, and the tiny model cut down (``TWO_LAYERS``)."""
    config_map, js = k8s.workload_objects(_workload("cpu/tiny", "tiny", storage="pvc:runs"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(config_map["data"]["recipe.yaml"])
    run, port = tmp_path / "run", free_ports()
    command = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["hypertron", "train", "/etc/hypertron/recipe.yaml"]
    procs = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    for index in (0, 1):
        env = k8s.pod_environment(js, index)
        host, _, _ = env["JAX_COORDINATOR_ADDRESS"].rpartition(":")
        assert host == "tiny-workers-0-0.tiny"
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"127.0.0.1:{port}"
        env = processes.fast_compile(env)  # and compiled fast, as the suite's other multi-process jobs
        procs.append(processes.start(
            [sys.executable, "-m", "hypertron.cli", "train", str(recipe), f"run_dir={run}", "train.steps=100000",
             "train.log_every=1", "monitor.collect=false", *TWO_LAYERS],  # the model cut down: steps are not the work
            env=base | env, stdout=processes.DEVNULL, stderr=processes.PIPE, text=True))
    try:
        events = run / "events.jsonl"
        deadline = time.monotonic() + 240
        while not (events.exists() and sum(e["event"] == "step" for e in read_events(events)) >= 3):
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs]
            assert time.monotonic() < deadline, "no third step in 240 s"
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [k8s.PREEMPT_EXIT_CODE] * 2, [p.stderr.read()[-2000:] for p in procs]
    rows = read_events(events)
    assert [r["process_count"] for r in rows if r["event"] == "job_start"] == [2]
    ready = [r for r in rows if r["event"] == "backend_ready"]
    assert [(r["device_count"], r["local_device_count"]) for r in ready] == [(4, 2)]
    assert read_events(run / "events.1.jsonl")[0]["process"] == 1  # pod 1 was process 1 of the same job
    reached = max(r["step"] for r in rows if r["event"] == "step")
    assert [r["status"] for r in rows if r["event"] == "job_end"] == ["preempted"]
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == reached < 100000  # saved at the step reached, then exited with the restart code


def test_launch_local_gives_each_process_its_own_gpus():
    from hypertron.launch.local import gpu_slices, parse_gpus, process_env

    assert gpu_slices(parse_gpus("8"), 4) == ["0,1", "2,3", "4,5", "6,7"]
    assert gpu_slices(parse_gpus(None, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}), 2) == ["4,5", "6,7"]
    assert parse_gpus(None, {}) == []  # nothing visible: nothing to split
    env = process_env({"PATH": "/bin"}, 1, 2, 1234, None, {"NCCL_DEBUG": "WARN"}, "6,7")
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["JAX_PROCESS_ID"] == "1" and env["NCCL_DEBUG"] == "WARN"
    with pytest.raises(UserError, match="do not split evenly over 3 processes"):
        gpu_slices(parse_gpus("8"), 3)
    with pytest.raises(UserError, match="distinct GPU ids"):
        parse_gpus("0,0")


def test_a_gke_tpu_pods_environment_lets_jax_find_its_processes():
    """In a TPU workload's pod hypertron sets no JAX_* variables: GKE's TPU webhook gives each VM
    TPU_WORKER_HOSTNAMES, and the JobSet MEGASCALE_*; jax.distributed.initialize() then finds the
    processes itself (no arguments but the timeouts). One VM of one slice is one process."""
    from hypertron.config import DistributedConfig
    from hypertron.parallel import distributed

    cfg = DistributedConfig()
    assert distributed.settings(cfg, {"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "2"}) == {
        "initialization_timeout": 300, "heartbeat_timeout_seconds": 100}
    assert distributed.settings(cfg, {"MEGASCALE_NUM_SLICES": "2", "TPU_WORKER_HOSTNAMES": "a"}) is not None
    assert distributed.settings(cfg, {"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "1"}) is None
