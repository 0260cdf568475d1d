"""Running `python -m jaxfrontier.sweep` in the tests, and reading back the PNG plots it writes."""

import json
import subprocess
import sys

from processes import REPO, subprocess_env

# configs/tiny.py (fsdp 2, global batch 16) with a 2-layer, 32-wide model: a trial takes ~15 s here.
# The LR schedule spans a fixed 100 steps, not train.steps (which the sweep sets from --warmup and
# --steps), so a layout compiles to the same program in every sweep test: the session's compile
# cache (conftest) serves the repeats.
SMALL = ('--config=configs/tiny.py', '--config.model.d_model=32', '--config.model.seq_len=32',
         '--config.optim.decay_steps=100')


def sweep(workdir, *args, env=None, timeout=600):
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.sweep', *SMALL, f'--workdir={workdir}', *args],
                          cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)


def png_axes(path):
    from PIL import Image  # matplotlib's own dependency
    with Image.open(path) as img:
        img.load()
        assert img.size[0] > 200 and img.size[1] > 200
        low, high = img.convert('L').getextrema()
        assert high - low > 100, path  # not blank
        return json.loads(img.text['jaxfrontier:axes'])
