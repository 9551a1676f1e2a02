"""`duet bench spec`: what each drafter and acceptance rule buys, against no drafts, in one run.

For a prose prompt and a copy-heavy one, every drafter the checkpoint supports runs under both
rules with the same seed; the table shows tokens per cycle, acceptance, lossy keeps, decode tok/s
and the speed-up over no drafts measured in the same run. Each setting runs `--repeats` times, the
settings taking turns (so a slow spell of the machine falls on all of them), and the median tok/s
counts: on the demo a run lasts ~0.1 s, and one run each moved the same setting by +-30%. Each
round's own speed-up (a setting's run over that round's run without drafts) is kept too, and the
table shows the middle half of them: how far the figure moves with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics

from duet.engine import Accept, Draft, DuetError, Finished, GenerateOptions, SamplingParams, generate, load_model

PROSE = "Tell me of the sea, and of the ships that go down to it."
COPY = ("Repeat this passage exactly, but write 'sea' where it says 'waters':\n"
        "And God said, Let the waters under the heaven be gathered together unto one place, and let the dry "
        "land appear: and it was so. And God called the dry land Earth; and the gathering together of the "
        "waters called he Seas: and God saw that it was good.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per run (default 96)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature (default 0.7, with top-k 20 and top-p 0.95 as the seed's runs; 0 greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each setting, taking turns; the median counts (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
    from duet.app.settings import bundled_demo_model

    if args.repeats < 1:
        raise DuetError(f"--repeats must be at least 1 (got {args.repeats})")
    lm = load_model(args.model or bundled_demo_model())
    sampling = SamplingParams(temperature=args.temperature, top_k=20 if args.temperature else 0,
                              top_p=0.95 if args.temperature else 1.0, seed=args.seed)
    drafters = [Draft.NONE, Draft.NGRAM] + ([Draft.MTP] if lm.model.mtp is not None else [])
    rows = []
    for prompt_name, text in (("prose", PROSE), ("copy", COPY)):
        ids = lm.tokenizer.encode(lm.tokenizer.render_chat([{"role": "user", "content": text}]))
        finished_stats(lm, ids, GenerateOptions(max_tokens=8, draft=Draft.NONE))  # warm caches before timing
        settings = [(drafter, rule) for drafter in drafters
                    for rule in ([Accept.EXACT] if drafter == Draft.NONE else list(Accept))]
        runs = {setting: [] for setting in settings}
        for _ in range(args.repeats):
            for drafter, rule in settings:
                options = GenerateOptions(max_tokens=args.max_tokens, sampling=sampling, draft=drafter, accept=rule)
                runs[(drafter, rule)].append(finished_stats(lm, ids, options))
        baseline_runs = [s.decode_tok_s for s in runs[(Draft.NONE, Accept.EXACT)]]
        baseline = statistics.median(baseline_runs)
        for (drafter, rule), repeats in runs.items():
            stats, tok_s = repeats[0], statistics.median(s.decode_tok_s for s in repeats)  # same seed: same tokens each run
            # each round's speed-up over that round's run without drafts: how far the figure moves with the machine
            by_round = [s.decode_tok_s / b for s, b in zip(repeats, baseline_runs) if b]
            rows.append({
                "prompt": prompt_name, "drafter": drafter, "accept": rule,
                "generated_tokens": stats.generated_tokens, "tokens_per_cycle": round(stats.tokens_per_cycle, 3),
                "acceptance_rate": round(stats.acceptance_rate, 3), "n_lossy": stats.n_lossy,
                "lossy_rate": round(stats.lossy_rate, 4), "decode_tok_s": round(tok_s, 2),
                "decode_tok_s_runs": [round(s.decode_tok_s, 2) for s in repeats],
                "speedup": round(tok_s / baseline, 3) if baseline else 0.0,
                "speedup_runs": [round(x, 3) for x in by_round],
                "speedup_quartiles": [round(x, 3) for x in quartiles(by_round)],
            })
    result = {"benchmark": "spec", "model": lm.name, "temperature": args.temperature, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "runs": rows}
    print(json.dumps(result) if args.json else spec_table(result))
    return 0


def quartiles(values: list[float]) -> tuple[float, float]:
    """The lower and upper quartiles of values (both the value when there is one; (0, 0) for none)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (0.0, 0.0)
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def finished_stats(lm, ids: list[int], options: GenerateOptions):
    """Run one generation to its end; the stats of its Finished event."""
    events = list(generate(lm, ids, options))
    assert isinstance(events[-1], Finished)
    return events[-1].stats


def spec_table(result: dict) -> str:
    header = (f"duet bench spec · {result['model']} · temperature {result['temperature']} · "
              f"{result['max_tokens']} tokens a run · median of {result['repeats']} runs each\n"
              f"{'prompt':7} {'drafter':7} {'accept':6} {'tok/cycle':>9} {'accepted':>8} {'lossy':>6} "
              f"{'decode tok/s':>12} {'vs none':>7}  {'rounds, middle half':>19}")
    lines = [f"{r['prompt']:7} {r['drafter']:7} {r['accept']:6} {r['tokens_per_cycle']:9.2f} "
             f"{r['acceptance_rate']:8.1%} {r['n_lossy']:6d} {r['decode_tok_s']:12.1f} {r['speedup']:6.2f}x"
             f"  {r['speedup_quartiles'][0]:12.2f}-{r['speedup_quartiles'][1]:.2f}x"
             for r in result["runs"]]
    return "\n".join([header, *lines])

