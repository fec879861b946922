"""A user's job on the GPU host, end to end: a chat dataset, a held-out eval set, a TRL-style reward file,
checkpoints every few steps, a resume, and the saved checkpoint loaded back in transformers and in vLLM.

    python benchmarks/real_job.py --out DIR [--shape qwen2-0.5b] [--lora]

1. examples/data/make_datasets.py writes the count-chat dataset (train + eval JSONL).
2. A job of --steps steps with --save-every (checkpoints written from the pool after the next offload, the
   last one after a final offload), --eval-every (greedy completions through the colocated vLLM).
3. The same job resumed (--resume auto) for --more steps.
4. The last checkpoint: transformers (the model, or base + peft adapter) and a fresh vLLM engine (the model,
   or base + LoRARequest) generate greedily for the eval prompts; their tokens are compared with each other
   (a sequence may part only where transformers' top two logits are within --tie of each other) and with
   the job's own last eval (the trainer's weights in the colocated vLLM, from <out>/evals/step-<N>.jsonl).

Writes DIR/real_job.json: job wall times, each checkpoint's save time and size, eval metrics, the greedy
agreement. vLLM runs eager here: this checks checkpoints and resume; CUDA-graph capture would only add
startup to three engine starts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_config(args, data: Path, out: Path, steps: int, resume: bool) -> dict:
    cfg = {"backend": args.backend, "model_shape": args.shape, "dataset": str(data / "train.jsonl"),
           "eval_dataset": str(data / "eval.jsonl"), "eval_every": args.save_every, "eval_prompts": args.eval_prompts,
           "chat_template": str(ROOT / "examples" / "chat" / "template.jinja"),
           "rewards": [str(ROOT / "examples" / "chat" / "rewards.py") + ":digits_in_place"],
           "steps": steps, "save_every": args.save_every, "prompts_per_step": 16, "micro_batch": 32,
           "lr": 1e-5 if not args.lora else 1e-4, "max_model_len": 256, "gpu_memory_utilization": 0.3,
           "progress": False, "report_to": ["tensorboard"], "out": str(out), "enforce_eager": True,
           "grpo": {"group_size": 8, "max_new_tokens": 8}, "phase_timeout_s": 300}
    if args.lora:
        cfg.update(lora={"r": 16}, save_merged=True)
    if resume:
        cfg["resume"] = "auto"
    return cfg


def run(cfg: dict) -> tuple[dict, float]:
    from colomem.runner import run_job
    from colomem.runner.config import config_from_dict

    t0 = time.perf_counter()
    res = run_job(config_from_dict(cfg))
    wall = time.perf_counter() - t0
    gc.collect()
    return res.summary, wall


def eval_lines(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("event") == "eval"]


def hf_greedy(model_dir: Path, base_dir: str, lora: bool, prompts: list[list[int]], new: int):
    import torch
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32      # as the trainers hold it
    model = AutoModelForCausalLM.from_pretrained(base_dir if lora else model_dir, dtype=dtype).to(dev)
    if lora:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, model_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            g = model.generate(torch.tensor([ids], device=dev), max_new_tokens=new, do_sample=False,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            toks = g.sequences[0, len(ids):].tolist()
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in g.scores]
            out.append((toks, gaps))
    del model
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def vllm_greedy(model_dir: Path, base_dir: str, lora: bool, prompts: list[list[int]], new: int):
    from vllm import LLM, SamplingParams

    kw = dict(enable_lora=True, max_lora_rank=16) if lora else {}
    llm = LLM(model=base_dir if lora else str(model_dir), enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=256, seed=0, **kw)
    req = None
    if lora:
        from vllm.lora.request import LoRARequest
        req = LoRARequest("checkpoint", 1, str(model_dir))
    sp = SamplingParams(temperature=0.0, max_tokens=new)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=req)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return toks


def agree(a: list[int], b: list[int], gaps: list[float], tie: float, eos: int) -> tuple[bool, int]:
    """(equal up to the end or a near-tie, tokens compared). EOS ends a sequence."""
    n = 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return gaps[i] < tie, n
        n += 1
        if x == eos:
            return True, n
    return True, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="real_job.json and the jobs' small outputs")
    p.add_argument("--work", help="the jobs' folders with their checkpoints (GBs); default OUT/work")
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--backend", default="gpu", help="cpu: a smoke run of the script (tiny shape, no vLLM check)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--more", type=int, default=2, help="steps of the resumed run")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--tie", type=float, default=0.1, help="logit gap under which two greedy picks may differ")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "work"
    data = work / "data"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "make_datasets.py"), str(data)], check=True)
    data = data / "count-chat"
    job = work / "job"
    first, wall1 = run(job_config(args, data, job, args.steps, resume=False))
    second, wall2 = run(job_config(args, data, job, args.steps + args.more, resume=True))
    ckpts = sorted((job / "checkpoints").iterdir(), key=lambda q: int(q.name.split("-")[1]))
    last = ckpts[-1]
    sizes = {q.name: sum(f.stat().st_size for f in q.rglob("*") if f.is_file()) for q in ckpts}

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(last / "model")
    evals = eval_lines(job)
    from colomem.grpo.dataset_task import DatasetTask
    task = DatasetTask(str(data / "eval.jsonl"), max_new_tokens=8)
    task.bind(tok, chat_template=str(ROOT / "examples" / "chat" / "template.jinja"), log=lambda *_: None)
    texts = [s.prompt for s in task.head(args.eval_prompts)]         # what the job's evaluations read
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    steps_done = args.steps + args.more
    job_rows = [json.loads(x) for x in (job / "evals" / f"step-{steps_done}.jsonl").read_text().splitlines()]
    job_tokens = [r["token_ids"] for r in sorted(job_rows, key=lambda r: r["index"])]
    base_dir = second["model"]
    hf = hf_greedy(last / "model", base_dir, args.lora, prompts, 8)
    vl = vllm_greedy(last / "model", base_dir, args.lora, prompts, 8) if args.backend == "gpu" else job_tokens
    pairs = [agree(h[0], v, h[1], args.tie, tok.eos_token_id) for h, v in zip(hf, vl)]
    exact = sum(h[0] == v for h, v in zip(hf, vl))
    # the trainer's own final weights, as the colocated vLLM generated with them in the job's last evaluation
    job_pairs = [agree(h[0], j, h[1], args.tie, tok.eos_token_id) for h, j in zip(hf, job_tokens)]
    job_vs_vllm = sum(j == v for j, v in zip(job_tokens, vl))
    result = {
        "command": " ".join(sys.argv), "shape": args.shape, "lora": args.lora,
        "first_run": {"status": first["status"], "wall_s": wall1, "steps_done": first["steps_done"],
                      "checkpoint_s": first.get("checkpoint_s"), "final_checkpoint": first.get("final_checkpoint"),
                      "phase_s_median": first.get("phase_s_median"), "step_s_median": first.get("step_s_median")},
        "resumed_run": {"status": second["status"], "wall_s": wall2, "steps_done": second["steps_done"],
                        "checkpoint_s": second.get("checkpoint_s"),
                        "final_checkpoint": second.get("final_checkpoint")},
        "checkpoint_bytes": sizes, "checkpoints": [q.name for q in ckpts],
        "evals": [{k: v for k, v in e.items() if k.startswith("eval/") or k == "step"} for e in evals],
        "greedy": {"prompts": len(prompts), "hf_vs_vllm_exact": exact,
                   "hf_vs_vllm_agree_up_to_near_tie": sum(ok for ok, _ in pairs),
                   "tokens_compared": sum(n for _, n in pairs),
                   "job_eval_vs_vllm_exact": job_vs_vllm,
                   "job_eval_vs_hf_agree_up_to_near_tie": sum(ok for ok, _ in job_pairs),
                   "vllm_tokens": vl[:4], "hf_tokens": [h[0] for h in hf[:4]], "job_tokens": job_tokens[:4]},
    }
    for name in ("metrics.jsonl", "summary.json", "evals"):          # the small outputs, next to the JSON
        src = job / name
        if src.is_dir():
            shutil.copytree(src, out / name, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, out / name)
    (out / "real_job.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("first_run", "resumed_run", "greedy")}, indent=1, default=str))
    ok = (first["status"] == second["status"] == "ok" and all(ok for ok, _ in pairs)
          and all(ok for ok, _ in job_pairs) and len(job_tokens) == len(prompts))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    main()
