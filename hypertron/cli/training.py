"""``hypertron train``, ``plan``, ``generate``, ``convert``, ``tokenize`` and ``embed plan``: the
commands over a training config, a model or its data."""

from __future__ import annotations

import argparse
import sys

from hypertron.cli.flags import (add_command, add_command_group, add_json_flag, bytes_arg, flag, number_arg,
                                 recipe_config)
from hypertron.config import TOKENIZABLE_SOURCES, ConfigError, choices
from hypertron.config.numbers import INT32
from hypertron.config.schema import WeightQuantization
from hypertron.config.serving import KvCacheDtype


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``train``, ``plan``, ``generate``, ``convert``, ``embed plan`` and ``tokenize`` to ``sub``."""
    for add in (_add_train, _add_plan, _add_generate, _add_convert, _add_embed, _add_tokenize):
        add(sub)


def _add_train(sub: argparse._SubParsersAction) -> None:
    t = add_command(sub, "train", cmd_train, help="train a model")
    t.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    pl = add_command(sub, "plan", cmd_plan,
                     help="memory per device, compute and communication time of a training config, before launch")
    pl.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    _add_hardware_flags(pl, "the accelerator: a name in the hardware table (default %(default)s; a name not in "
                        "it lists them)")
    add_json_flag(pl, "the plan")
    se = pl.add_argument_group("searching (--search)")
    se.add_argument("--search", action="store_true",
                    help="rank the meshes (over the nodes or TPU slices too), remat policies and micro-batch counts "
                         "that fit by predicted step time, and print the fastest (docs/memory.md)")
    se.add_argument("--top", type=number_arg(int), default=5, metavar="N", help="how many to print (default %(default)s)")
    se.add_argument("--published", action="store_true",
                    help="the published results the step prediction is fitted on and held to, each beside its "
                         "prediction (docs/memory.md)")
    sv = pl.add_argument_group("serving (--serve)")
    sv.add_argument("--serve", action="store_true",
                    help="plan one serving engine instead: weights and workspace per device, and the KV cache's "
                         "tokens in the memory left (docs/memory.md)")
    sv.add_argument("--tensor", type=number_arg(int), default=1, metavar="N",
                    help="split heads, MLP and vocabulary over N devices (hypertron serve --tensor)")
    sv.add_argument("--expert", type=number_arg(int), default=1, metavar="N", help="split an MoE's experts over N devices")
    sv.add_argument("--quantize", choices=choices(WeightQuantization), default="none", help="the served weights")
    sv.add_argument("--kv-cache-dtype", choices=choices(KvCacheDtype), default="auto",
                    help="auto = the model's compute dtype")


def _add_hardware_flags(parser: argparse.ArgumentParser, hardware_help: str) -> None:
    """``--hardware`` (a name in the hardware table) and ``--devices N`` (plan, embed plan)."""
    parser.add_argument("--hardware", default="h100", help=hardware_help)
    parser.add_argument("--devices", type=number_arg(int), default=None, metavar="N", help="default: one node's")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = add_command(sub, "generate", cmd_generate, help="continue a prompt from a checkpoint")
    g.add_argument("--checkpoint", "--model", dest="checkpoint", required=True, metavar="DIR",
                   help="run directory (its latest checkpoint) or Hugging Face model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=number_arg(int), default=64)
    g.add_argument("--temperature", type=number_arg(float), default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=number_arg(int), default=0, help="0 or -1 = off")
    g.add_argument("--top-p", type=number_arg(float), default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=number_arg(int), default=0)
    g.add_argument("--quantize", choices=choices(WeightQuantization), default="none",
                   help="weight precision: int8 = int8 weights with per-channel scales, quantised after loading")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    c = add_command(sub, "convert", cmd_convert,
                    help="import or export Hugging Face checkpoints, or merge a LoRA adapter into its base")
    c.add_argument("--from-hf", metavar="DIR", help="HF directory (config.json + safetensors) to import")
    c.add_argument("--out", metavar="DIR",
                   help="model bundle to write (with --from-hf or --lora): a new or empty directory")
    c.add_argument("--to-hf", metavar="DIR", help="HF directory to write (with --checkpoint)")
    c.add_argument("--checkpoint", "--model", dest="checkpoint", metavar="DIR",
                   help="model bundle or run directory to export (with --to-hf), or the base of --lora (default: "
                        "the adapter's base_model_name_or_path)")
    c.add_argument("--lora", metavar="DIR", help="PEFT LoRA adapter directory to merge into its base (with --merge "
                   "and --out)")
    c.add_argument("--merge", action="store_true", help="with --lora: write the base with the adapter merged in")


def _add_embed(sub: argparse._SubParsersAction) -> None:
    ema = add_command_group(sub, "embed", help="sharded embedding tables")
    ep = add_command(ema, "plan", cmd_embed_plan, help="where each embedding table goes over the devices, and why")
    ep.add_argument("spec", metavar="SPEC.yaml")
    _add_hardware_flags(ep, "the device, for its memory (default %(default)s; cpu: this host's memory shared by "
                        "the devices)")
    ep.add_argument("--device-memory", type=bytes_arg, default=None, metavar="BYTES",
                    help="memory per device for the tables (e.g. 60GB), in place of the hardware's")
    ep.add_argument("--batch", type=number_arg(int, low=1, high=INT32[1]), default=None, metavar="N",
                    help="samples per step, in place of the file's")
    add_json_flag(ep, "the plan")


def _add_tokenize(sub: argparse._SubParsersAction) -> None:
    k = add_command(sub, "tokenize", cmd_tokenize, help="pre-tokenise a corpus for data.source=tokens")
    k.add_argument("--source", required=True, choices=TOKENIZABLE_SOURCES)
    k.add_argument("--paths", nargs="*", default=[], metavar="PATH", help="files or directories")
    k.add_argument("--text-field", default="text", help="the text column / key (jsonl, parquet, hf)")
    k.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json (or its directory) "
                   "or a SentencePiece .model")
    k.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")


def _config(args: argparse.Namespace):
    """The config of ``[RECIPE] key=value ...`` (train, plan)."""
    return recipe_config(args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model. Arguments: an optional YAML recipe, then key=value overrides (e.g. model=tiny
    train.steps=200 mesh.fsdp=-1). Resumes from the latest checkpoint in run_dir."""
    cfg = _config(args)
    from hypertron.train.loop import train

    trackers = []
    if cfg.monitor.collect or cfg.monitor.port:
        from hypertron.monitor.collector import Collector

        trackers.append(Collector(cfg.run_dir, cfg.monitor))
    result = train(cfg, trackers=trackers)
    return cfg.train.preempt_exit_code if result.status == "preempted" else 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan a training run on hardware you may not have: per-device memory (parameters, gradients, optimiser
    state exact; activations estimated), compute time at the device's peak, communication per mesh axis, and the
    predicted step time and MFU. Exit 1 when it does not fit. docs/memory.md has the formulas."""
    import json

    from rich.console import Console

    from hypertron.models import plan as planner

    if args.published:
        from hypertron.models import published

        if args.serve or args.search or args.overrides:
            raise ConfigError("--published: lists the published runs the prediction is held to; it takes no "
                              "config, --serve or --search")

        compared = published.compare()
        if args.json:
            print(json.dumps([published.to_json(c) for c in compared], indent=1))
        else:
            console = Console()
            console.width = max(console.width, 120)
            console.print(published.render(compared))
        return 0
    cfg = _config(args)
    if args.serve:
        if args.search:
            raise ConfigError("--search: plans a training run's meshes; not with --serve")
        return _plan_serving(cfg, args)
    given = [f for f, default in (("tensor", 1), ("expert", 1), ("quantize", "none"), ("kv_cache_dtype", "auto"))
             if getattr(args, f) != default]
    if given:
        raise ConfigError(f"{flag(given[0])}: only with --serve (a training plan's split is mesh.tensor=N, mesh.expert=N)")
    if cfg.task == "dlrm":
        if args.search:
            raise ConfigError("--search: ranks a decoder's meshes; task=dlrm's tables are placed by the embedding "
                              "planner (hypertron plan task=dlrm without --search)")
        return _plan_dlrm(cfg, args)
    if cfg.task == "diffusion":  # the planner counts a decoder's parameters: it would plan the config's unused model
        raise ConfigError("task=diffusion: hypertron plan does not plan a diffusion denoiser yet (it plans "
                          "task=lm, sft, dpo and dlrm)")
    if args.search:
        return _plan_search(cfg, args)
    p = planner.plan(cfg, args.hardware, args.devices)
    if args.json:
        print(json.dumps(planner.to_json(p), indent=1))
    else:
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits is not False else 1


def _plan_search(cfg, args: argparse.Namespace) -> int:
    """``hypertron plan --search``: the fastest meshes, remat policies and micro-batch counts that fit
    (:mod:`hypertron.models.search`); exit 1 when none does."""
    import json

    from rich.console import Console

    from hypertron.hardware import lookup
    from hypertron.models import plan as planner
    from hypertron.models import search

    if args.top < 1:
        raise ConfigError(f"--top={args.top}: must be at least 1")
    devices = lookup(args.hardware).per_node if args.devices is None else args.devices
    found, planned = search.search(cfg, args.hardware, devices, top=args.top)
    if args.json:
        print(json.dumps({"planned": planned, "found": [
            {"overrides": list(c.overrides), "plan": planner.to_json(c.plan)} for c in found]}, indent=1))
    else:
        console = Console()
        console.width = max(console.width, 160)
        console.print(search.render(found, planned))
    return 0 if found else 1


def _plan_serving(cfg, args: argparse.Namespace) -> int:
    """``hypertron plan --serve``: one engine of ``cfg.model`` over ``--tensor`` x ``--expert`` devices
    of ``--hardware`` (``--devices``, if given, must be that many); exit 1 when it does not fit."""
    import json

    from rich.console import Console

    from hypertron.config import EngineConfig, SchedulerConfig
    from hypertron.hardware import host_memory_per_device, lookup
    from hypertron.models.serve_plan import plan_serving, render, to_json

    devices = args.tensor * args.expert
    if args.devices is not None and args.devices != devices:
        raise ConfigError(f"--devices={args.devices}: --serve plans one engine over --tensor x --expert = {devices} "
                          "devices")
    hw = lookup(args.hardware)
    p = plan_serving(cfg.model, hw, tensor=args.tensor, expert=args.expert, quantize=args.quantize,
                     kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=SchedulerConfig.max_num_batched_tokens,
                     max_slots=EngineConfig.max_slots, page_size=EngineConfig.page_size,
                     device_memory=host_memory_per_device(devices) if hw.memory is None else None)
    if args.json:
        print(json.dumps(to_json(p), indent=1))
    else:
        Console(soft_wrap=True).print(render(p), highlight=False)
    return 0 if p.fits else 1


def _plan_dlrm(cfg, args: argparse.Namespace) -> int:
    """``hypertron plan`` of a recommender: its sizes (abstract shapes) and its tables placed over
    ``--devices`` of ``--hardware`` by the embedding planner; exit 1 when they do not fit."""
    import json

    from rich.console import Console

    from hypertron.config.validation import check_dlrm_devices
    from hypertron.embed import plan as planner
    from hypertron.hardware import lookup
    from hypertron.recsys import dlrm
    from hypertron.units import describe_bytes

    devices, device_memory = _devices(args)
    processes = -(-devices // lookup(args.hardware).per_node)
    check_dlrm_devices(cfg, devices, processes)  # as train checks them
    d = cfg.dlrm
    tables, features = dlrm.table_specs(d, d.placement)
    sizes = dlrm.sizes(d)
    dense = 4 * sizes["dense_params"] * (1 if d.optimizer == "sgd" else 2)  # replicated: parameters (+ Adagrad)
    memory = int(device_memory) - dense
    p = planner.plan(tables, features, {f.name: float(h) for f, h in zip(features, d.ids_per_sample)},
                     shards=devices, batch=cfg.train.global_batch, device_bytes=max(memory, 1),
                     split_all=processes > 1)  # as make_dlrm_trainer places them
    if args.json:
        print(json.dumps({"dlrm": d.name, **sizes, "dense_bytes_per_device": dense, "tables": planner.to_json(p)},
                         indent=1))
    else:
        Console(soft_wrap=True).print(
            f"{d.name}: {sizes['params']:,} parameters ({sizes['table_params']:,} in {len(tables)} tables, "
            f"{sizes['dense_params']:,} dense); with {d.optimizer}'s state "
            f"{describe_bytes(sizes['param_bytes'] + sizes['optimizer_bytes'])} in all; every device also holds the "
            f"MLPs ({describe_bytes(dense)}), so the tables have {describe_bytes(max(memory, 0))} of each",
            highlight=False)
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits else 1


def _devices(args: argparse.Namespace) -> tuple[int, float]:
    """``--devices`` of ``--hardware`` (default: one node's) and the bytes of each one's memory
    (``--device-memory`` where given; ``cpu``: this host's, shared)."""
    from hypertron.hardware import host_memory_per_device, lookup

    hw = lookup(args.hardware)
    devices = hw.per_node if args.devices is None else args.devices
    if devices < 1:
        raise ConfigError(f"--devices={devices}: must be at least 1")
    return devices, getattr(args, "device_memory", None) or hw.memory or host_memory_per_device(devices)


def cmd_generate(args: argparse.Namespace) -> int:
    from hypertron.serve.generate import generate
    from hypertron.serve.model import load_for_inference
    from hypertron.serve.types import SamplingError

    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}: must be positive")
    model, params, tok = load_for_inference(args.checkpoint, args.quantize)
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(args.prompt)
    try:
        (out,) = generate(
            params, model, [ids], args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_ids=tok.eos_ids,
        )
    except SamplingError as e:  # SamplingParams' message (the server's 400), naming the flag
        raise ConfigError(e.named({"max_tokens": "--max-new-tokens"}.get(e.field, flag(e.field)))) from None
    print(args.prompt + tok.decode(out))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    if (args.from_hf or args.lora) and not args.out:
        raise ConfigError(f"convert {'--lora' if args.lora else '--from-hf'} needs --out DIR")
    if sum(map(bool, (args.from_hf, args.to_hf, args.lora))) != 1:
        raise ConfigError("convert: give exactly one of --from-hf DIR, --to-hf DIR or --lora DIR")
    if args.merge and not args.lora:
        raise ConfigError("convert --merge is for --lora DIR")
    from pathlib import Path

    from hypertron.models import bundle, hf

    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory; choose a new one")
    if args.lora:
        return _merge_lora(args, out)
    if args.from_hf:
        model_cfg, params = hf.load_hf(args.from_hf)
        has_tokenizer = any((Path(args.from_hf) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        bundle.save_model(out, model_cfg, params, args.from_hf if has_tokenizer else "byte")
        print(f"wrote the model bundle {out} ({model_cfg.name})")
    else:
        if not args.checkpoint:
            raise ConfigError("convert --to-hf needs --checkpoint RUN_DIR (or a model bundle)")
        model_cfg, params, tokenizer = _read_model(args.checkpoint)
        hf.save_hf(args.to_hf, model_cfg, params)
        copied = bundle.copy_tokenizer(tokenizer, args.to_hf, names=("tokenizer.json", "tokenizer.model"))
        print(f"wrote Hugging Face checkpoint {args.to_hf}" + (" with its tokenizer" if copied else ""))
    return 0


def _read_model(path: str):
    """``(model config, parameters, tokenizer)`` of a model bundle or a run's newest checkpoint."""
    from hypertron.checkpoint import load_params
    from hypertron.models import bundle

    if bundle.is_bundle(path):
        _, tokenizer = bundle.read_config(path)
        model_cfg, params, _ = bundle.read_bundle(path)
        return model_cfg, params, tokenizer
    cfg, params = load_params(path)
    return cfg.model, params, cfg.data.tokenizer


def _merge_lora(args: argparse.Namespace, out) -> int:
    """``convert --lora ADAPTER --merge --out OUT [--model BASE]``: the base's bundle with the adapter
    merged into its weights (what ``hypertron serve`` reads)."""
    import jax

    from hypertron.models import bundle
    from hypertron.models.lora import load_peft, merge, peft_config

    if not args.merge:
        raise ConfigError("convert --lora needs --merge (the adapter directory is already PEFT's format)")
    base = args.checkpoint or peft_config(args.lora).get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(f"--lora {args.lora}: its adapter_config.json names no base_model_name_or_path; give --model "
                          "BASE")
    model_cfg, params, tokenizer = _read_model(base)
    adapters, settings = load_peft(args.lora, model_cfg)
    merged = jax.device_get(merge(params, adapters, settings))
    bundle.save_model(out, model_cfg, merged, tokenizer)
    print(f"wrote the model bundle {out}: {base} with the adapter {args.lora} merged (rank {settings.rank})")
    return 0


def cmd_embed_plan(args: argparse.Namespace) -> int:
    """Place each table of a spec file (YAML: batch, tables, features; docs/embeddings.md) table-wise, row-wise
    or column-wise over the devices: bytes held per device, ids and bytes exchanged per step, the reason for
    each choice. A table's placement set in the file is kept. Exit 1 when the tables do not fit."""
    import json

    from rich.console import Console

    from hypertron.config import read_yaml
    from hypertron.embed import plan as planner

    doc = read_yaml(args.spec, "embedding tables file")
    tables, features, per, batch = planner.load(doc, args.spec)
    if args.batch is not None:
        batch = args.batch
    devices, memory = _devices(args)
    p = planner.plan(tables, features, per, shards=devices, batch=batch, device_bytes=int(memory))
    if args.json:
        print(json.dumps(planner.to_json(p), indent=1))
    else:
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits else 1


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Tokenise a corpus once into ArrayRecord shards of int32 ids; train on it with data.source=tokens
    data.paths=[OUT] and the same data.tokenizer. Never overwrites: --out must be new or an empty directory."""
    from hypertron.data.pretokenize import tokenize_corpus

    metadata = tokenize_corpus(
        source=args.source, paths=tuple(args.paths), text_field=args.text_field,
        tokenizer=args.tokenizer, out=args.out, log=lambda line: print(line, file=sys.stderr),
    )
    print(f"wrote {metadata['num_documents']} documents, {metadata['num_tokens']} tokens in "
          f"{len(metadata['shards'])} shards to {args.out} (train with data.source=tokens)")
    return 0
