"""The router carries no torch: it tokenizes, processes images and videos with numpy and Pillow
and computes rope indexes, so it starts in about half a second and holds about 70 MB
(with torch: 2.2 s and 250 MB, measured 2026-12-01)."""

from __future__ import annotations

import subprocess
import sys

from tests.cluster.harness import ROOT


def test_the_router_and_its_preprocessing_import_no_torch() -> None:
    code = ("import sys, cli.router, router.server, router.preprocess, router.http_door; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
