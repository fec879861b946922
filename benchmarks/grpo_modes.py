"""bench_grpo's jobs and modes: which config each job runs, the runner flags of each mode, the modes a peer's
script runs instead (TRL), and the top-level speedups of the planner's default against the other layouts.
What each mode measures: bench_grpo's docstring."""
from __future__ import annotations

CONFIGS = {"full": "configs/grpo_1p5b_full.yaml", "lora": "configs/grpo_1p5b_lora.yaml",
           "lora7b": "configs/grpo_7b_lora.yaml", "full7b": "configs/grpo_7b_full.yaml",
           "bigkv": "configs/grpo_1p5b_bigkv.yaml"}
MODES = {"colomem": ["--switch", "colomem"],
         # every checkpointed layer recomputed, as the config asks (the default trims where memory is free)
         "recompute": ["--switch", "colomem", "--trim-recompute", "false"],
         "shared_recompute": ["--switch", "colomem", "--shared-base", "--trim-recompute", "false"],
         # every layer recomputed and the micro-batch grown in the memory that leaves (the default trims first,
         # then grows in what the trim left): which of the two the free memory buys more with
         "recompute_grow": ["--switch", "colomem", "--trim-recompute", "false", "--grow-micro-batch"],
         "colomem_all": ["--switch", "colomem", "--offload", "all", "--rollout-sleep", "always"],
         "resident": ["--switch", "colomem", "--offload", "none", "--rollout-sleep", "always"],
         "still": ["--switch", "colomem", "--offload", "none", "--rollout-sleep", "never"],
         # nothing moves and no layer recomputed: a forced placement measures nothing, so it cannot trim the
         # recompute as the default does; where the activations fit, this is nothing-moves at its fastest
         "still_nogc": ["--switch", "colomem", "--offload", "none", "--rollout-sleep", "never",
                        "--gradient-checkpointing", "false"],
         # the planner's with vLLM's whole sleep where it sleeps (the default releases only the part of its KV
         # cache training needs)
         "wholesleep": ["--switch", "colomem", "--kv-release", "all"],
         # the planner's with the released part of the KV cache lent as each layer's tail, mapped back only as
         # the rollout's blocks run short; and in whole layers, mapped back before each rollout
         "kvtail": ["--switch", "colomem", "--kv-release", "tail"],
         "kvlayers": ["--switch", "colomem", "--kv-release", "layers"],
         # the two above in one process, step by step (what differs between launches is the same for both)
         "alternate": ["--switch", "colomem", "--offload", "none", "--rollout-sleep", "alternate"],
         "timesplit": ["--switch", "timesplit"],
         "overlap": ["--switch", "colomem", "--overlap-offload"],      # the planner's, offload behind the wake
         # the planner's with all of the trainer's memory in expandable segments (releases never wait for copies)
         "expandable": ["--switch", "colomem", "--trainer-expandable"],
         # both: the optimizer state's offload overlaps the weights' wake only where its release cannot wait
         # for the copies (a cudaFree of default segments waits for every copy in flight)
         "hidden": ["--switch", "colomem", "--trainer-expandable", "--overlap-offload"],
         # the planner's with Adam's moments in memory colomem maps chunk by chunk (part back behind training)
         "mapped": ["--switch", "colomem", "--optimizer-state-memory", "mapped"],
         # the planner's with vLLM's own generator instead of per-request seeds (TRL's sampling)
         "enginerng": ["--switch", "colomem", "--rollout-seeding", "engine"],
         # the seeded requests' noise drawn in one launch (the default), and by vLLM's sampler, a launch each
         "batchednoise": ["--switch", "colomem", "--seeded-noise", "batched"],
         "vllmnoise": ["--switch", "colomem", "--seeded-noise", "vllm"],
         # LoRA: one copy of the base (vLLM in the rank, the trainer on its weights) and the same engine with two
         "shared": ["--switch", "colomem", "--shared-base"],
         # the same with the adapter merged into the base for each rollout (no LoRA kernels in vLLM's decode)
         "shared_merged": ["--switch", "colomem", "--shared-base", "--shared-base-rollout", "merged"],
         "inrank": ["--switch", "colomem", "--engine", "in-rank"],
         # vLLM in a process of its own (the default puts it in the trainer's process): its longer start-up
         "crossproc": ["--switch", "colomem", "--engine", "cross-process"],
         # the planner's with a checkpoint every other step (the newest one kept), written in the background
         "saved": ["--switch", "colomem", "--save-every", "2", "--keep-checkpoints", "1"],
         "trl": [], "trl_sleep": ["--trl-sleep"],
         # the same recompute on both sides, interleaved in one call (RECOMPUTE_PAIRS): no checkpointing, and
         # checkpointing every other decoder layer (the TRL harness applies --checkpoint-every to its model)
         "nogc": ["--switch", "colomem", "--gradient-checkpointing", "false"],
         "shared_nogc": ["--switch", "colomem", "--shared-base", "--gradient-checkpointing", "false"],
         "trl_nogc": ["--gradient-checkpointing", "false"],
         "ckpt2": ["--switch", "colomem", "--gradient-checkpointing", "true", "--checkpoint-every", "2"],
         "trl_ckpt2": ["--gradient-checkpointing", "true", "--checkpoint-every", "2"],
         # the same micro-batch of 32 rows on both sides (TRL's per_device_train_batch_size), and the planner's
         # with the micro-batch it grows to from the measured memory
         "mb32": ["--switch", "colomem", "--micro-batch", "32"],
         "trl_mb32": ["--micro-batch", "32"],
         "grow": ["--switch", "colomem", "--grow-micro-batch"],
         "shared_mb32": ["--switch", "colomem", "--shared-base", "--micro-batch", "32"],
         "shared_grow": ["--switch", "colomem", "--shared-base", "--grow-micro-batch"],
         # the decoder layers' parts compiled, on both sides (the TRL harness compiles its model the same way)
         "compile": ["--switch", "colomem", "--torch-compile"],
         "shared_compile": ["--switch", "colomem", "--shared-base", "--torch-compile"],
         "trl_compile": ["--torch-compile"],
         # the planner's checkpointing setting taken (--trim-recompute), alone and with the compiled layers; TRL
         # with its layers compiled and no checkpointing (its fastest setting where it fits)
         "trim": ["--switch", "colomem", "--trim-recompute"],
         "shared_trim": ["--switch", "colomem", "--shared-base", "--trim-recompute"],
         "tuned": ["--switch", "colomem", "--torch-compile", "--trim-recompute"],
         "shared_tuned": ["--switch", "colomem", "--shared-base", "--torch-compile", "--trim-recompute"],
         # and the micro-batch grown in the memory the trim leaves
         "tuned_grow": ["--switch", "colomem", "--torch-compile", "--trim-recompute", "--grow-micro-batch"],
         "shared_tuned_grow": ["--switch", "colomem", "--shared-base", "--torch-compile", "--trim-recompute",
                               "--grow-micro-batch"],
         "trl_tuned": ["--torch-compile", "--gradient-checkpointing", "false"],
         # vLLM's KV cache sized to what the rollout can hold (--kv-cache-bytes auto), alone and tuned
         "kvauto": ["--switch", "colomem", "--kv-cache-bytes", "auto"],
         "tuned_kv": ["--switch", "colomem", "--torch-compile", "--trim-recompute", "--grow-micro-batch",
                      "--kv-cache-bytes", "auto"]}
# modes a peer's script runs instead of the runner (with the same --config, --steps and --extra flags)
PEER_SCRIPTS = {m: "benchmarks/bench_trl.py" for m in ("trl", "trl_sleep", "trl_nogc", "trl_ckpt2", "trl_mb32",
                                                        "trl_compile", "trl_tuned")}
PEER_MODULES = {m: "trl" for m in PEER_SCRIPTS}          # what must be importable, else the mode is skipped
PEER_ONLY_FLAGS = {"--trl-sleep"}                       # a peer mode's flags the runner does not take
# top-level speedups of the planner's default against each other layout, on the full fine-tune
VERSUS = {"timesplit": "speedup_vs_timesplit", "colomem_all": "speedup_vs_offload_all",
          "resident": "speedup_vs_resident", "still": "speedup_vs_all_resident",
          "still_nogc": "speedup_vs_all_resident_nogc",
          "trl": "speedup_vs_trl", "trl_sleep": "speedup_vs_trl_sleep", "enginerng": "speedup_vs_enginerng",
          "batchednoise": "speedup_vs_batchednoise", "vllmnoise": "speedup_vs_vllmnoise"}
