"""Would this config's model fit the machine scripts/launch.sh runs on outside SLURM? One line and exit 1
when not.

    python scripts/launch_fit.py --ranks 8 --config-file train_configs/llama3_8b_pipemorph.toml
    python scripts/launch_fit.py --ranks 4 --config llama3_70b_pipemorph

The model size comes from the config's model flavor (TOML: ``[model] flavor``; a 0.3 config function:
the flavor in its name), the need is parameters x 16 bytes (bf16/fp32 weights, gradients, AdamW's two
states), against the GPUs' total memory (nvidia-smi), else the RAM (/proc/meminfo). Standard library
only: it runs before anything is imported.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tomllib

#: parameters of TorchTitan's llama3 flavors (and the debug model's order of magnitude)
PARAMS = {"debugmodel": 7e6, "8b": 8.0e9, "70b": 70.6e9, "405b": 405.9e9}
BYTES_PER_PARAM = 16


def flavor_of(config_file: str | None, config: str | None) -> str | None:
    if config_file:
        with open(config_file, "rb") as f:
            return str(tomllib.load(f).get("model", {}).get("flavor", "")).lower() or None
    match = re.search(r"(debugmodel|405b|70b|8b)", (config or "").lower())
    return match.group(1) if match else None


def local_memory() -> tuple[float, str]:
    """(bytes, what) of the GPUs here, else of the RAM."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout.split()
            if out:
                return sum(float(mib) for mib in out) * 2**20, f"{len(out)} GPU(s)"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib * 1024.0, "RAM"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-file")
    p.add_argument("--config")
    p.add_argument("--ranks", type=int, default=1)
    a = p.parse_args()
    flavor = flavor_of(a.config_file, a.config)
    if flavor not in PARAMS:
        return 0  # an unknown flavor: nothing to say about its size
    need = PARAMS[flavor] * BYTES_PER_PARAM
    have, what = local_memory()
    if need > have:
        print(f"launch.sh: {a.config_file or a.config}: the llama3 {flavor} model needs about {need / 2**30:.0f} GiB "
              f"(parameters x {BYTES_PER_PARAM} bytes) and this machine's {what} hold {have / 2**30:.0f} GiB: "
              f"run it on a cluster (sbatch scripts/launch.sh), or pick a debug config", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
