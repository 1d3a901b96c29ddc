"""The forward's overhead, interleaved, forward only (no backward timed): plain torch.compile (static
batch), torch.compile with the batch dim dynamic, capskip_fx.compile (rule dense; forced keep 0.5).
DeiT-tiny depth 4, img 32, N = 128, 1 thread.  Median ms per forward per block of 5 rounds, arms rotating.

    python benchmarks/forward_overhead.py
"""
import statistics, time, torch, timm, capskip_fx
torch.set_num_threads(1)
torch.manual_seed(0)
m = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, num_classes=10).train()
x = torch.randn(128, 3, 32, 32); y = torch.randint(0, 10, (128,))
import copy
arms = {}
a = copy.deepcopy(m); arms["static"] = torch.compile(a)
b = copy.deepcopy(m); cb = torch.compile(b, dynamic=None)
def dyn(x, cb=cb):
    torch._dynamo.mark_dynamic(x, 0); return cb(x)
arms["dynamic batch"] = dyn
c = copy.deepcopy(m); cc = capskip_fx.compile(c, rule="dense")
arms["capskip dense"] = lambda x, cc=cc: cc(x, capskip_targets=y)
d = copy.deepcopy(m); cd = capskip_fx.compile(d, rule="forced", keep=0.5)
arms["capskip forced 0.5"] = lambda x, cd=cd: cd(x, capskip_targets=y)
for n, f in arms.items():  # warm-up: compile forward and backward
    for _ in range(2):
        f(x).sum().backward() if n.startswith("s") or n.startswith("d") else torch.nn.functional.cross_entropy(f(x), y).backward()
names = list(arms); res = {n: [] for n in names}
for blk in range(6):
    t = {n: [] for n in names}
    for r in range(5):
        for n in names[r % 4:] + names[:r % 4]:
            t0 = time.perf_counter(); out = arms[n](x); t1 = time.perf_counter()
            t[n].append(t1 - t0); del out
    for n in names: res[n].append(statistics.median(t[n]))
base = res["static"]
for n in names:
    rat = [v / b for v, b in zip(res[n], base)]
    print(f"{n:20s} fwd {1e3*statistics.median(res[n]):7.1f} ms  ratio to static {statistics.mean(rat):.3f} (blocks {min(rat):.3f}-{max(rat):.3f})")
