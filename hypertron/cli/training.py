"""``hypertron train``, ``plan``, ``generate``, ``convert``, ``tokenize`` and ``embed plan``: the
commands over a training config, a model or its data."""

from __future__ import annotations

import argparse
import sys


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
    from hypertron.units import describe_bytes
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
            f"{describe_bytes(sizes['param_bytes'] + sizes['optimizer_bytes'])} in all; every device also holds the "
            f"MLPs ({describe_bytes(dense)}), so the tables have {describe_bytes(max(memory, 0))} of each",
            highlight=False)
        Console(soft_wrap=True).print(planner.render(p))
    return 0 if p.fits else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from hypertron.config import ConfigError
    from hypertron.serve.generate import generate
    from hypertron.serve.model import load_for_inference

    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}: must be positive")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature}: must not be negative")
    if args.top_k < 0:
        raise ConfigError(f"--top-k={args.top_k}: must not be negative (0 = off)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p}: must be in (0, 1]")
    model, params, tok = load_for_inference(args.checkpoint, args.quantize)
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
            model_cfg, params, _ = bundle.read_bundle(args.checkpoint)
        else:
            cfg, params = load_params(args.checkpoint)
            model_cfg, tokenizer = cfg.model, cfg.data.tokenizer
        hf.save_hf(args.to_hf, model_cfg, params)
        copied = bundle.copy_tokenizer(tokenizer, args.to_hf, names=("tokenizer.json", "tokenizer.model"))
        print(f"wrote Hugging Face checkpoint {args.to_hf}" + (" with its tokenizer" if copied else ""))
    return 0


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
