"""What ``python -m sglang.train.dspark`` writes next to the draft: the loss plot and README.md.

Both are derived from the run's log (the dict that also becomes ``train_log.json``), so the
README states exactly the command, data, time and evaluation numbers of that run.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

__all__ = ["plot_losses", "write_readme"]


def plot_losses(log: Dict[str, Any], path: Path) -> bool:
    """Training loss terms and held-out accept length over steps; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tr = log["train"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "total"), ("tv", "L1 (tv)"), ("ce", "CE"),
                       ("conf", "confidence BCE")):
        axes[0].plot(tr["steps"], tr[key], lw=0.6, alpha=0.8, label=label)
    axes[0].set_title("training loss terms")
    axes[0].set_xlabel("step")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    ev = tr["eval"]
    steps = [e["step"] for e in ev]
    axes[1].plot(steps, [e["accept_length"] for e in ev], "o-", label="greedy accept length")
    axes[1].plot(steps, [e["tau_sampling"] for e in ev], "s-", label="expected tau at T=1")
    axes[1].set_title("held-out (teacher-forced anchors)")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("tokens per verify round")
    axes[1].legend()
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(values: List[float], digits: int = 3) -> str:
    return ", ".join("n/a" if math.isnan(v) else f"{v:.{digits}f}" for v in values)


def _lossless(run: Dict[str, Any]) -> str:
    if "matches_plain_greedy" not in run:
        return ""
    return f" (outputs equal to plain greedy decoding: {run['matches_plain_greedy']:.0%})"


def write_readme(path: Path, log: Dict[str, Any]) -> None:
    """A short README.md: how the folder was produced and what it scores."""
    cfg, data, tr, ev = log["config"], log["data"], log["train"], log["eval"]
    args = log["args"]
    weights = sum(p.stat().st_size for p in path.parent.iterdir()
                  if p.name == "model.safetensors")
    lines = [
        "# DSpark draft",
        "",
        f"A {cfg['num_hidden_layers']}-layer DSpark draft (gamma {cfg['block_size']}, Markov "
        f"rank {cfg['markov_rank']}, confidence head) for the target in `{args['target_path']}`"
        f", reading target layers {cfg['target_layer_ids']}. "
        f"{log['parameters'] / 1e6:.2f} M parameters, `model.safetensors` "
        f"{weights / 1e6:.1f} MB ({cfg['torch_dtype']}). Load it with "
        "`sglang.srt.models.dspark.load_dspark_draft`.",
        "",
        "## How it was produced",
        "",
        "```",
        log["command"],
        "```",
        "",
        f"Device {log['device']}, torch {log['torch']}, Python {log['python']}; "
        f"{log['total_seconds']:.0f} s in all, of which training {tr['seconds']:.0f} s "
        f"({tr['num_steps']} steps, {tr['blocks']} anchor blocks, stopped by {tr['stopped_by']}).",
        "",
        "Data: prompts of "
        f"{args['prompt_len']} tokens from the training corpus (`sglang.train.data`), continued "
        f"{args['max_new_tokens']} tokens by the target through `sglang.Engine`, "
        f"{args['prompts_per_setting']} prompts under each sampling setting "
        f"({', '.join(data['sampling'])})"
        + (f": {data['train_generated_tokens']} generated training tokens" if
           "train_generated_tokens" in data else "")
        + f". Held-out: {args['eval_prompts']} prompts from the corpus' held-out files, "
        "continued greedily. Target features: a prefill of each sequence on the engine's model.",
        "",
        f"Loss: {args['alpha_ce']} CE + {args['alpha_tv']} L1 + {args['alpha_conf']} confidence "
        f"BCE + {args['alpha_accept']} acceptance-aware (-E[accepted prefix] / gamma), position "
        f"weights exp(-k / {args['loss_decay_gamma']}).",
        "",
        "## Held-out evaluation",
        "",
        f"Greedy speculative decoding simulated offline on {ev['sequences']} held-out sequences "
        f"({ev['anchors']} anchors): accept length **{ev['accept_length']:.3f}** committed "
        f"tokens per verify round ({ev['verify_rounds']} rounds, gamma {ev['gamma']}); averaged "
        f"over every anchor {ev['accept_length_all_anchors']:.3f}.",
        "",
        f"Prefix acceptance per slot: {_fmt(ev['slot_accept'])}"
        + (f"; slot 1 at the anchors the rounds start at: {ev['round_anchor_slot1_accept']:.3f}"
           if "round_anchor_slot1_accept" in ev else "") + ".",
    ]
    if "ece" in ev:
        lines += ["", f"Confidence calibration (ECE of the predicted prefix survival, 20 bins) "
                      f"per slot: {_fmt(ev['ece'])}; mean **{ev['mean_ece']:.3f}**."]
    if "served" in ev:
        sv = ev["served"]
        lines += ["", "Served through `sglang.Engine` (`--speculative-algorithm DSPARK`, this "
                      f"folder as the draft) on the same prompts: accept length "
                      f"**{sv['accept_length']:.3f}**" + _lossless(sv) + "."]
    for key in sorted((k for k in ev if k.startswith("nextn")),
                      key=lambda k: ev[k]["speculative_num_steps"]):
        nx = ev[key]
        lines += ["", "The target's NEXTN (MTP) layer on the same prompts through the engine, "
                      f"{nx['speculative_num_steps']} chained drafts per round: accept length "
                      f"**{nx['accept_length']:.3f}**" + _lossless(nx) + "."]
    lines += ["", "Per-step losses and periodic evaluations: `train_log.json`"
              + (", plotted in `loss_curve.png`." if log.get("plot") else "."), ""]
    path.write_text("\n".join(lines))
