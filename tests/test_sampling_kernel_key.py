"""The compiled kernels' cache key (rollout/cpu/kernels.py build_name) includes the Python ABI:
two venvs with other Pythons and the same torch sharing TORCH_EXTENSIONS_DIR build apart instead
of rebuilding over each other's modules."""

from __future__ import annotations

import sysconfig

import pytest

from verl_megatron.rollout.cpu import kernels as cpu_kernels


@pytest.mark.parametrize("arch", cpu_kernels.ARCHES)
def test_the_build_name_changes_with_the_python_abi(monkeypatch, arch):
    before = cpu_kernels.build_name(arch)
    real = sysconfig.get_config_var

    def other_python(name):
        return ".cpython-312-x86_64-linux-gnu.so" if name == "EXT_SUFFIX" else real(name)

    monkeypatch.setattr(sysconfig, "get_config_var", other_python)
    after = cpu_kernels.build_name(arch)
    assert after != before, f"another Python's ABI left the {arch} build's name {before} unchanged"
    assert after.startswith(f"verl_megatron_decode_kernels_{arch}_")
