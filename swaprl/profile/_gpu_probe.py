# temporary GPU probe for swaprl.profile (to be deleted)
import json, os, time
import pynvml
import torch
from transformers import AutoModelForCausalLM
import swaprl
from swaprl import memory
from swaprl.checkpoints import write_random_checkpoint
from swaprl.profile.recorder import _private_pool_bytes

dev = torch.device("cuda:0")
torch.zeros(1, device=dev)
print("pynvml", getattr(pynvml, "__version__", "?"), pynvml.__file__, [n for n in dir(pynvml) if "PciBusId" in n])
def _handle(device):
    props = torch.cuda.get_device_properties(device)
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
if os.environ.get("PATCH"):
    memory._nvml_handle = _handle
nv = memory._nvml()
h = _handle(dev)
print("procs", [(p.pid, p.usedGpuMemory) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)], "me", os.getpid())
mi = nv.nvmlDeviceGetMemoryInfo(h); print("v1 used", mi.used, "total", mi.total, "mem_get_info used", torch.cuda.mem_get_info()[1]-torch.cuda.mem_get_info()[0])
try:
    m2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2); print("v2 used", m2.used, "reserved", m2.reserved)
except Exception as e: print("v2 fail", e)
print("reserved", torch.cuda.memory_reserved(), "private", _private_pool_bytes(dev))
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
print("after mempool: reserved", torch.cuda.memory_reserved(), "private", _private_pool_bytes(dev))
del x, pool
torch.cuda.empty_cache()
print("after pool del: reserved", torch.cuda.memory_reserved(), "private", _private_pool_bytes(dev))

ck = write_random_checkpoint("qwen2.5-0.5b", "/tmp/ck05", layers=4, dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).to(dev)
opt = torch.optim.AdamW(model.parameters())
path = os.path.join(os.environ["OUT"], f"gpu_run{os.environ.get('PATCH', '')}.jsonl")
rt = swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(profile=path))
t = time.time()
for c in range(5):
    with swaprl.phase("generate"):
        out = rt.engine.generate([[1, 2, 3]] * 8, swaprl.Sampling(max_tokens=32, seed=0))
    with swaprl.phase("train"):
        ids = torch.tensor([[1, 2, 3, *o] for o in out], device=dev)
        model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()
print("loop s", time.time() - t)
swaprl.detach()
for line in open(path):
    r = json.loads(line)
    if r.get("type") == "phase":
        print(r["phase"], r["cycle"], {k: round(v / 2**20, 1) for k, v in r["attribution"]["categories"].items()}, r["attribution"]["notes"])
    if "schema" in r:
        print({k: r[k] for k in ("nvml", "device_used_source", "copy_bandwidth", "device_name")})
