#!/usr/bin/env bash
# One prepared call for a session lent a GPU (../shared/GPU.md): the device tool's `run` with
#   bash bench/gpu_session.sh        (timeout_s 600; each item has its own limit and writes under $OUT at once)
# Uses the machine's own python3 (CUDA torch, transformers); paratrain from this tree on PYTHONPATH, nothing installed.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi -L
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
} >"$OUT/env.txt" 2>&1
# 1. what landed since the last GPU session, CUDA against the CPU (tests/gpu)
timeout 230 python3 -m pytest tests/gpu -q -s -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "GPU-PARITY|passed|failed|Error" 
# 2. speed: compiled plain loop vs engine (AdamW) vs engine (Muon) vs engine fp8 (tensorwise, rowwise), gpt3-xl then gpt2
timeout 240 python3 -m bench.bench_gpu --models gpt3-xl --only 4,5,10,11,12 --steps 8 --warmup 3 \
  --json "$OUT/gpt3xl.json" >"$OUT/bench-gpt3xl.log" 2>&1
tail -8 "$OUT/bench-gpt3xl.log"
# 4. the newcomer path: `paratrain train` with no flags on the one GPU (cut off after 50 s)
timeout 50 python3 -m paratrain train --no-progress >"$OUT/newcomer.log" 2>&1
tail -6 "$OUT/newcomer.log"
timeout 70 python3 -m bench.bench_gpu --models gpt2 --only 4,5,10 --steps 10 --warmup 3 \
  --json "$OUT/gpt2.json" >"$OUT/bench-gpt2.log" 2>&1
tail -8 "$OUT/bench-gpt2.log"
# 5. fp8 against bf16 over a run: gpt3-xl compiled, the loss curves (bench/bench_fp8.py; last: cut off if time is short)
timeout 150 python3 -m bench.bench_fp8 --device cuda --model gpt3-xl --global-batch 16 --micro-batch 8 --steps 60 \
  --compile --lr 3e-4 --json "$OUT/fp8-gpt3xl.json" >"$OUT/fp8.log" 2>&1
tail -4 "$OUT/fp8.log"
