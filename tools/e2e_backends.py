"""The 4-layer dummy of a model preset, written in a scheme's checkpoint layout, loaded with emulation experts on
each backend: logits against the bf16 model and the backends against each other (benchmarks/h200_e2e_gpt_oss.json).

    python tools/e2e_backends.py PRESET SCHEME DEVICE OUT.json BACKENDS
    (e.g. gpt-oss-20b w_mxfp4 cuda out.json fused,triton,torch)
"""

import json
import sys
import time

import torch

from mxlib.analysis import sqnr_db
from mxlib.moe.base import TritonExperts
from mxlib.studies import steps as W

preset, scheme, device, out_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
backends = sys.argv[5].split(",")
res = dict(preset=preset, scheme=scheme, device=device, torch=torch.__version__)
if device == "cuda":
    res["gpu"] = torch.cuda.get_device_name()
p = W.check_e2e_parameters(
    scheme=scheme,
    model_preset=preset,
    device=device,
    experts_backend=backends[0],
    results_path="",
    num_tokens=64,
    calib_tokens=512,
)
t = time.time()
m = W.build_model(p)
res["build_s"] = time.time() - t
t = time.time()
ck = W.write_checkpoint(p, m)
res["write_s"] = time.time() - t
ids = W.evaluation_token_ids(p, m.config.vocab_size).to(device)
ref = W.run_model(m, ids).logits.float().cpu()
del m
t = time.time()
mq, info = W.load_checkpoint(p, ck)
res["load_s"] = time.time() - t
logits = {}
for be in backends:
    for mod in mq.modules():
        if isinstance(mod, TritonExperts):
            mod.backend = be
    W.run_model(mq, ids)  # warm-up (kernel compilation)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.time()
    o = W.run_model(mq, ids)
    res[f"forward_s_{be}"] = time.time() - t
    logits[be] = o.logits.float().cpu()
    res[f"sqnr_vs_bf16_db_{be}"] = sqnr_db(logits[be], ref)
    res[f"top1_agree_vs_bf16_{be}"] = float((logits[be].argmax(-1) == ref.argmax(-1)).float().mean())
    res[f"finite_{be}"] = bool(torch.isfinite(logits[be]).all())
for be in backends[1:]:
    res[f"sqnr_{backends[0]}_vs_{be}_db"] = sqnr_db(logits[backends[0]], logits[be])
print(json.dumps(res, indent=1))
json.dump(res, open(out_path, "w"), indent=1)
