"""vLLM 0.26 on CUDA: does an unseeded greedy request move numpy's global generator (Model Runner V2), a seeded one
not? Prints one JSON line. Run on one GPU, with a directory for the tiny random checkpoint it writes:

    python benchmarks/vllm_rng.py DIR

The run on one H100 and its log: benchmarks/results/trl_h100x2/rng/.
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, as TRL's colocate engine and swaprl's run it

import numpy as np
import torch

from swaprl.checkpoints import write_random_checkpoint

if __name__ != "__main__":
    raise SystemExit
path = write_random_checkpoint("tiny", sys.argv[1], dtype=torch.bfloat16)
from vllm import LLM, SamplingParams  # noqa: E402

llm = LLM(str(path), enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256, skip_tokenizer_init=True)


def moved(params) -> bool:
    key, pos = np.random.get_state()[1].copy(), np.random.get_state()[2]
    llm.generate([{"prompt_token_ids": [0, 1]}], params, use_tqdm=False)
    return not (np.array_equal(key, np.random.get_state()[1]) and pos == np.random.get_state()[2])


np.random.randint(0, 2)  # past the first draw, which fills the key array
print(json.dumps({"greedy_unseeded_moves_numpy": moved(SamplingParams(max_tokens=1, temperature=0.0)),
                  "seeded_moves_numpy": moved(SamplingParams(max_tokens=4, temperature=1.0, seed=1234)),
                  "unseeded_sampling_moves_numpy": moved(SamplingParams(max_tokens=4, temperature=1.0))}))
