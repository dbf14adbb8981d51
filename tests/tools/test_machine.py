"""bik.testing.machine: the CPU as plain torch's bits see it, recorded with every RL run (its
warm-up cache is keyed on it): two CPUs that torch reports alike but that round apart must
differ."""

import torch

from bik.testing import machine


def test_an_amx_xeon_and_an_epyc_of_one_vector_capability_are_told_apart(monkeypatch):
    capability = torch.backends.cpu.get_cpu_capability()
    xeon = {"model name": "Intel(R) Xeon(R) Platinum", "flags": "fpu avx512f amx_bf16 amx_tile"}
    epyc = {"model name": "AMD EPYC", "flags": "fpu avx512f avx512_bf16"}
    monkeypatch.setattr(machine, "_cpuinfo", lambda: xeon)
    assert machine.cpu_numerics() == f"Intel(R) Xeon(R) Platinum ({capability}, AMX)"
    monkeypatch.setattr(machine, "_cpuinfo", lambda: epyc)
    assert machine.cpu_numerics() == f"AMD EPYC ({capability})"
    assert machine.device_name(torch.device("cpu")).startswith("AMD EPYC (")


def test_the_first_processors_fields_are_read_from_proc_cpuinfo():
    fields = machine._cpuinfo()
    assert machine.cpu_model() == fields.get("model name", machine.cpu_model())
    assert "processor" in fields or not fields  # the first block only, or no /proc/cpuinfo


def test_the_demo_names_the_cpus_capability_and_warns_on_a_busy_machine(monkeypatch):
    """Issue 71, item 3: the demo's figures depend on the CPU (AVX2, AVX-512, AVX512-BF16,
    AMX) and on what else runs; its first line says both."""

    capability = torch.backends.cpu.get_cpu_capability()
    epyc = {"model name": "AMD EPYC", "flags": "fpu avx512f avx512_bf16"}
    monkeypatch.setattr(machine, "_cpuinfo", lambda: epyc)
    assert machine.cpu_capability() == f"{capability}, AVX512-BF16"
    monkeypatch.setattr(machine, "machine_load", lambda: {"load_1min": 0.1, "cpus": 2})
    line = machine.machine_line()
    assert line.startswith(f"machine: AMD EPYC ({capability}, AVX512-BF16), ")
    assert "load average 0.10 on 2 CPUs" in line and "warning" not in line
    monkeypatch.setattr(machine, "machine_load", lambda: {"load_1min": 1.9, "cpus": 2})
    assert "warning: other work is running here" in machine.machine_line()
