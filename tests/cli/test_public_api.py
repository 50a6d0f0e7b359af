"""What `import adopter` offers a user: optimize and the errors it raises, without importing torch."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_errors_optimize_raises_import_from_the_package_without_torch():
    code = ("import sys, adopter; from adopter import AdopterWarning, OptimizeError, UserError; "
            "assert 'torch' not in sys.modules; assert sorted(adopter.__all__) == "
            "['AdopterWarning', 'OptimizeError', 'UserError', 'optimize']; print(OptimizeError.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "adopter.errors"


def test_optimize_raises_the_exported_error_for_what_it_cannot_optimize():
    import adopter

    class NotAModule:
        pass

    with pytest.raises(adopter.OptimizeError):
        adopter.optimize(NotAModule)
