"""The doctor's checks on environments built by hand (a GPU machine whose JAX fell back to the CPU, CUDA
libraries shadowed from LD_LIBRARY_PATH or the system, a plugin of another JAX version, ...), and its
probes on hand-written input (/proc/self/maps, the driver's /proc file, nvidia-smi's CSV)."""

from __future__ import annotations

import dataclasses

from jaxllm.doctor.checks import (
    check_compilation_cache,
    check_cuda_plugins,
    check_gpu_in_use,
    check_gpu_memory,
    check_jax_installation,
    check_ld_library_path,
    check_loaded_libraries,
    exit_status,
    run_checks,
)
from jaxllm.doctor.facts import (
    CacheFacts,
    DeviceFacts,
    EnvironmentFacts,
    LibraryFile,
    NvidiaGpu,
    parse_driver_version,
    parse_maps,
    parse_nvidia_smi,
    soname_of,
    version_in_name,
)
from jaxllm.doctor.report import render_text, summary_line

SITE = "/venv/lib/python3.12/site-packages"
WHEELS = (
    LibraryFile(
        "libcublas.so.12", f"{SITE}/nvidia/cublas/lib/libcublas.so.12", "12.8.4.1", "nvidia-cublas-cu12"
    ),
    LibraryFile("libcudnn.so.9", f"{SITE}/nvidia/cudnn/lib/libcudnn.so.9", "9.8.0.87", "nvidia-cudnn-cu12"),
    LibraryFile("libnccl.so.2", f"{SITE}/nvidia/nccl/lib/libnccl.so.2", "2.26.2", "nvidia-nccl-cu12"),
)
H100 = NvidiaGpu(0, "NVIDIA H100 80GB HBM3", 81559, 4)


def healthy_gpu(**changes) -> EnvironmentFacts:
    """A working CUDA 12 installation on one H100: JAX on the GPU, the wheels' libraries loaded."""
    facts = EnvironmentFacts(
        python_version="3.12.3",
        packages={
            "jax": "0.11.2",
            "jaxlib": "0.11.2",
            "jax-cuda12-plugin": "0.11.2",
            "jax-cuda12-pjrt": "0.11.2",
        },
        gpu_evidence=("/proc/driver/nvidia/version",),
        driver_version="570.133.20",
        gpus=(H100,),
        backend="gpu",
        devices=(DeviceFacts(0, "gpu", H100.name, 64 * 2**30, 0),),
        loaded_libraries=WHEELS,
        wheel_libraries=WHEELS,
        compilation_cache=CacheFacts("/cache/xla", True, 10, 2**20, True),
    )
    return dataclasses.replace(facts, **changes)


def cpu_fallback(**changes) -> EnvironmentFacts:
    return healthy_gpu(backend="cpu", devices=(DeviceFacts(0, "cpu", "cpu"),), loaded_libraries=(), **changes)


def test_a_healthy_gpu_installation_has_no_findings():
    facts = healthy_gpu()
    assert run_checks(facts) == [] and exit_status([]) == 0
    text = render_text(facts, [])
    assert (
        "cuBLAS             12.8.4.1  /venv/lib/python3.12/site-packages/nvidia/cublas/lib/libcublas.so.12"
        in text
    )
    assert "(pip: nvidia-cublas-cu12)" in text and text.endswith("No problems found.")
    line = summary_line(facts, [])
    assert line.startswith(
        "Environment: Python 3.12.3, jax 0.11.2, jaxlib 0.11.2, CUDA plugin jax-cuda12-plugin 0.11.2, "
        "jax-cuda12-pjrt 0.11.2; JAX devices gpu"
    )
    assert "; libraries cuDNN 9.8.0.87 (pip), cuBLAS 12.8.4.1 (pip), NCCL 2.26.2 (pip);" in line
    assert "gpu: 1 device(s) (NVIDIA H100 80GB HBM3); free for XLA: 64.0 GiB" in line


def test_gpu_present_without_a_cuda_plugin_is_a_loud_error_naming_the_extra():
    no_plugin = {"jax": "0.11.2", "jaxlib": "0.11.2"}
    (f,) = check_gpu_in_use(cpu_fallback(packages=no_plugin))
    assert f.level == "error" and f.message.startswith("JAX FELL BACK TO THE CPU")
    assert "1 x NVIDIA H100 80GB HBM3" in f.message and "driver 570.133.20" in f.message
    assert f.fix == "pip install 'jaxllm[cuda12]'"  # driver 570: CUDA 13 needs 580
    (f,) = check_gpu_in_use(cpu_fallback(packages=no_plugin, driver_version="580.95.05"))
    assert f.fix == "pip install 'jaxllm[cuda13]'"
    (f,) = check_gpu_in_use(cpu_fallback(packages=no_plugin, driver_version="470.82.01"))
    assert f.fix == "update the NVIDIA driver to 525 or newer, then pip install 'jaxllm[cuda12]'"
    assert exit_status([f]) == 1


def test_a_cuda_plugin_that_did_not_start_names_why_and_the_driver_it_needs():
    facts = cpu_fallback(
        packages={
            "jax": "0.11.2",
            "jaxlib": "0.11.2",
            "jax-cuda13-plugin": "0.11.2",
            "jax-cuda13-pjrt": "0.11.2",
        },
        backend_errors={"cuda": "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"},
    )
    (f,) = check_gpu_in_use(facts)
    assert "jax-cuda13-plugin is installed" in f.message and "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" in f.message
    assert "driver 570.133.20 is older than CUDA 13 needs (580+)" in f.fix and "jaxllm[cuda12]" in f.fix
    # The plugin's own version check failed: JAX only logged a warning, which the finding quotes.
    (f,) = check_gpu_in_use(
        dataclasses.replace(
            facts,
            driver_version="580.95.05",
            backend_errors={},
            jax_warnings=(
                "CUDA version check failed during initialization. Outdated cuDNN installation found.",
            ),
        )
    )
    assert "Outdated cuDNN installation found" in f.message and "--force-reinstall 'jaxllm[cuda13]'" in f.fix


def test_jax_platforms_cpu_on_a_gpu_machine_is_only_a_warning():
    (f,) = check_gpu_in_use(cpu_fallback(jax_platforms="cpu"))
    assert f.level == "warning" and f.fix == "unset JAX_PLATFORMS" and exit_status([f]) == 0
    assert check_gpu_in_use(healthy_gpu(jax_platforms="cuda")) == []
    assert check_gpu_in_use(cpu_fallback(gpu_evidence=(), gpus=())) == []  # no GPU: the CPU is right


def test_plugin_versions_must_match_jax():
    packages = {
        "jax": "0.11.2",
        "jaxlib": "0.11.2",
        "jax-cuda12-plugin": "0.10.0",
        "jax-cuda12-pjrt": "0.11.2",
    }
    (f,) = check_cuda_plugins(healthy_gpu(packages=packages))
    assert "jax-cuda12-plugin 0.10.0" in f.message and f.fix == "pip install 'jax[cuda12]==0.11.2'"
    del packages["jax-cuda12-pjrt"]
    (f,) = check_cuda_plugins(healthy_gpu(packages=packages))
    assert "jax-cuda12-pjrt missing" in f.message
    both = {**healthy_gpu().packages, "jax-cuda13-plugin": "0.11.2", "jax-cuda13-pjrt": "0.11.2"}
    (f,) = check_cuda_plugins(healthy_gpu(packages=both))  # driver 570: keep CUDA 12
    assert f.level == "warning" and f.fix.endswith("pip uninstall -y jax-cuda13-plugin jax-cuda13-pjrt")
    (f,) = check_jax_installation(healthy_gpu(packages={**both, "jaxlib": "0.11.1"}))
    assert f.fix == "pip install jax==0.11.2 jaxlib==0.11.2"


def test_ld_library_path_folders_that_shadow_the_wheels_are_named_with_the_export_that_fixes_them():
    ld = ("/usr/local/cuda/lib64", "/opt/tools/lib", f"{SITE}/nvidia/cudnn/lib")
    facts = healthy_gpu(
        ld_library_path=ld,
        ld_library_path_libraries=(
            LibraryFile("libcublas.so.12", "/usr/local/cuda/lib64/libcublas.so.12", "12.2.5.6"),
            LibraryFile("libcudnn.so.9", "/usr/local/cuda/lib64/libcudnn.so.9", "9.1.0"),
            LibraryFile("libcufft.so.11", "/opt/tools/lib/libcufft.so.11"),  # no wheel ships it: no conflict
            WHEELS[1],  # the wheel's own folder on LD_LIBRARY_PATH: its own copy, no conflict
        ),
    )
    (f,) = check_ld_library_path(facts)
    assert f.level == "error"
    assert f.message.startswith(
        "LD_LIBRARY_PATH entry /usr/local/cuda/lib64 holds libcublas.so.12, libcudnn.so.9"
    )
    assert "nvidia-cublas-cu12, nvidia-cudnn-cu12" in f.message
    assert f.fix == (
        f"remove /usr/local/cuda/lib64 from LD_LIBRARY_PATH: export LD_LIBRARY_PATH=/opt/tools/lib:{SITE}/nvidia/cudnn/lib"
    )
    only = dataclasses.replace(
        facts, ld_library_path=ld[:1], ld_library_path_libraries=facts.ld_library_path_libraries[:2]
    )
    (f,) = check_ld_library_path(only)
    assert f.fix == "unset LD_LIBRARY_PATH (its only entry is /usr/local/cuda/lib64)"
    assert check_ld_library_path(dataclasses.replace(facts, wheel_libraries=())) == []  # nothing to shadow
    assert "/usr/local/cuda/lib64 (libcublas.so.12, libcudnn.so.9)" in render_text(facts, [f])


def test_a_loaded_library_from_outside_the_wheel_is_named_with_where_it_came_from():
    system = LibraryFile("libcudnn.so.9", "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0", "9.1.0")
    facts = healthy_gpu(loaded_libraries=(WHEELS[0], system, WHEELS[2]))
    (f,) = check_loaded_libraries(facts)
    assert f.message == (
        "libcudnn.so.9 is loaded from /usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0, not from the pip wheel "
        "nvidia-cudnn-cu12 that JAX's CUDA plugin was built against"
    )
    assert "came first" in f.fix and "ldconfig" in f.fix
    (f,) = check_loaded_libraries(dataclasses.replace(facts, ld_library_path=("/usr/lib/x86_64-linux-gnu",)))
    assert f.fix == "remove /usr/lib/x86_64-linux-gnu from LD_LIBRARY_PATH"
    twice = check_loaded_libraries(healthy_gpu(loaded_libraries=(*WHEELS, system)))
    assert [f.message.split(" ")[0:4] for f in twice] == [
        ["libcudnn.so.9", "is", "loaded", "from"],
        ["libcudnn.so.9", "is", "loaded", "twice,"],
    ]


def test_an_unwritable_compilation_cache_is_an_error_and_a_busy_gpu_a_warning():
    (f,) = check_compilation_cache(
        healthy_gpu(compilation_cache=CacheFacts("/cache/xla", True, 3, 10, False))
    )
    assert "/cache/xla is not writable" in f.message and "JAXLLM_CACHE_DIR" in f.fix
    assert check_compilation_cache(healthy_gpu(compilation_cache=CacheFacts(None))) == []
    busy = NvidiaGpu(1, "NVIDIA H100 80GB HBM3", 81559, 60000)
    (f,) = check_gpu_memory(healthy_gpu(gpus=(H100, busy)))
    assert f.level == "warning" and f.message.startswith(
        "GPU 1 (NVIDIA H100 80GB HBM3) already has 58.6 of 79.6 GiB"
    )


def test_probes_read_maps_driver_and_nvidia_smi():
    maps = "\n".join(
        [
            "7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
            f"7f0000002000-7f0000003000 r-xp 00001000 08:01 2 {SITE}/nvidia/cudnn/lib/libcudnn.so.9",
            f"7f0000003000-7f0000004000 r--p 00002000 08:01 2 {SITE}/nvidia/cudnn/lib/libcudnn.so.9",
            "7f0000005000-7f0000006000 r-xp 00000000 08:01 3 /usr/local/cuda/lib64/libcublasLt.so.12.2.5.6 (deleted)",
            "7f0000007000-7f0000008000 rw-p 00000000 00:00 0 ",
            "7f0000009000-7f000000a000 r-xp 00000000 08:01 4 /opt/x/libcudnn_ops.so.9",
            "7f000000b000-7f000000c000 r-xp 00000000 08:01 5 /opt/x/libcuda.so.570.133.20",
        ]
    )
    assert parse_maps(maps) == [
        f"{SITE}/nvidia/cudnn/lib/libcudnn.so.9",
        "/usr/local/cuda/lib64/libcublasLt.so.12.2.5.6",
        "/opt/x/libcudnn_ops.so.9",
    ]
    assert (
        soname_of("libcublasLt.so.12.2.5.6") == "libcublasLt.so.12"
        and soname_of("libnccl.so.2") == "libnccl.so.2"
    )
    assert version_in_name("libcudnn.so.9.1.0") == "9.1.0" and version_in_name("libcudnn.so.9") is None
    proprietary = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  Fri Mar 14 2025\nGCC version: gcc 12"
    )
    open_modules = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)"
    )
    assert parse_driver_version(proprietary) == "570.133.20"
    assert parse_driver_version(open_modules) == "580.95.05"
    smi = (
        "0, NVIDIA H100 80GB HBM3, 570.133.20, 81559, 4\n1, NVIDIA H100 80GB HBM3, 570.133.20, 81559, [N/A]\n"
    )
    assert parse_nvidia_smi(smi) == (
        "570.133.20",
        [H100, NvidiaGpu(1, "NVIDIA H100 80GB HBM3", 81559, None)],
    )
    assert parse_nvidia_smi(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    ) == (
        None,
        [],
    )
