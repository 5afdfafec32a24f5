import sys, statistics, torch, torch.nn.functional as F
from torch import nn
sys.argv = ["x"]
sys.path.insert(0, "benchmarks")
import e2e_hf as e
import gemmtune
from gemmtune.nn import TunedLinear

class PlainTuned(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

class ForcedTorch(nn.Linear):
    def forward(self, x):
        return gemmtune.gemm_a16w16(x, self.weight, self.bias, kernel="torch.linear")

def set_cls(model, cls):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = cls

import os, tempfile
dev = gemmtune.current_device()
rows = "".join(f"{dev.arch},{dev.cu_num},{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,False,torch,0,0,1.0,torch.linear,0,0,0\n"
               for name in ("llama3-70b-tp8", "llama3-8b") for m, n, k in e.gemm_shapes(name))
path = os.path.join(tempfile.mkdtemp(), "t.csv")
open(path, "w").write("arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n" + rows)
os.environ["GEMMTUNE_CONFIG_BF16"] = "replace:" + path
gemmtune.reset()
for name in ("llama3-70b-tp8", "llama3-8b"):
    model = e.build(name)
    with torch.no_grad():
        for b in (1, 8):
            p = e.DecodePoint(model, b)
            variants = {"linear": nn.Linear, "class-switch": PlainTuned, "op-forced": ForcedTorch, "TunedLinear-torch-rows": TunedLinear}
            for cls in variants.values():
                set_cls(model, cls); p.rewind(); p.step()
            ratios = {k: [] for k in variants}
            times = {k: [] for k in variants}
            for i in range(31):
                order = list(variants.items()) if i % 2 == 0 else list(reversed(variants.items()))
                for k, cls in order:
                    set_cls(model, cls)
                    times[k].append(e.eager_ms(p, 10))
                for k in variants:
                    ratios[k].append(times[k][-1] / times["linear"][-1])
            print(name, "b=%d" % b, {k: (round(statistics.median(times[k]), 3), round(statistics.median(ratios[k]), 3)) for k in variants})
    del model; torch.cuda.empty_cache()
print(gemmtune.format_misses(gemmtune.report_misses())[:300])
