"""Every Triton kernel in kestrel.kernels must hash its dependencies: on a GPU the first launch computes the kernel's
cache key, and Triton rejects a jit function that calls a plain Python function (the W4A8 PTX decode once did, and
every low-bit GEMM failed on the H200). The interpreter never computes it, so this runs in a subprocess without
TRITON_INTERPRET (no GPU needed)."""
import os
import subprocess
import sys

SCRIPT = r"""
import importlib, pkgutil, triton, kestrel.kernels as kk
bad, n = [], 0
for m in pkgutil.walk_packages(kk.__path__, "kestrel.kernels."):
    mod = importlib.import_module(m.name)
    for name, obj in vars(mod).items():
        if isinstance(obj, triton.runtime.jit.JITFunction) and obj.__module__ == mod.__name__:
            n += 1
            try:
                obj.cache_key
            except Exception as ex:
                bad.append(f"{m.name}.{name}: {ex}")
print(n, bad)
assert n > 10 and not bad, bad
"""


def test_every_kernel_hashes_its_dependencies():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(os.path.dirname(__file__), "..") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
