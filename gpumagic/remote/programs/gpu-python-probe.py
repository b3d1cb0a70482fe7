"""gpumagic's doctor: which Python, which environment, which PyTorch (gpumagic/gpu/doctor.py).

Run as ``python3 -c SOURCE`` by the ``torch`` section of gpu-sections.sh, with the login's
``python3`` (the one cells get); standard library only, any Python 3.  It prints

* ``sys.version`` on one line;
* ``env<TAB>KIND<TAB>sys.prefix``, KIND ``conda`` (a ``conda-meta`` folder in the prefix),
  ``venv`` (``sys.prefix != sys.base_prefix``) or ``system``;
* ``torch.__version__ torch.version.cuda`` (``2.11.0+cu130 13.0``; ``None`` for a CPU-only
  build), or ``no-torch ERROR`` when ``import torch`` fails.

The same shape as the recorded ``torch-version.txt`` (which lacks the env line); read by
``parse_torch_probe``.
"""
import os
import sys

print(sys.version.replace('\n', ' '))
kind = ('conda' if os.path.isdir(os.path.join(sys.prefix, 'conda-meta')) else
        'venv' if sys.prefix != sys.base_prefix else 'system')
print('env', kind, sys.prefix, sep='\t')
try:
    import torch
except Exception as e:
    print('no-torch', type(e).__name__ + ':', e)
else:
    print(torch.__version__, torch.version.cuda)
