"""Build colomem._C with ninja: a CUDA build when nvcc is found, a host-only build otherwise.

The core never links libtorch: one build serves any torch version. Every knob is an environment variable
(docs/env.md lists them all):

  COLOMEM_FORCE_CPU=1          host-only build even when nvcc is there
  CUDA_HOME / CUDA_PATH        where to find nvcc (else nvcc on PATH, else /usr/local/cuda)
  COLOMEM_CUDA_ARCHS="80;90"   SM architectures to compile device code for (PTX of the highest is added)
  COLOMEM_SANITIZE=address,undefined   build with sanitizers (host-only builds; see tests/test_sanitizers.py)
  COLOMEM_DEBUG=1              -O0 -g
  MAX_JOBS=N                   ninja parallelism
"""

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def read_version() -> str:
    ns: dict = {}
    exec((ROOT / "colomem" / "_version.py").read_text(), ns)
    return ns["__version__"]


def find_cuda():
    """(nvcc, cuda_home) from CUDA_HOME/CUDA_PATH, then nvcc on PATH, then /usr/local/cuda; None: host-only."""
    if os.environ.get("COLOMEM_FORCE_CPU", "0") not in ("", "0"):
        return None
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    on_path = shutil.which("nvcc")
    if on_path:
        homes.append(str(Path(on_path).resolve().parent.parent))
        try:  # nvcc may be a wrapper script: ask it where its toolkit lives
            out = subprocess.run([on_path, "--dryrun", "--version"], capture_output=True, text=True, timeout=60)
            for line in (out.stdout + out.stderr).splitlines():
                if line.startswith("#$ TOP="):
                    homes.append(line.split("=", 1)[1].strip())
        except (OSError, subprocess.SubprocessError):
            pass
    homes.append("/usr/local/cuda")
    for home in filter(None, homes):
        h = Path(home).resolve()
        if (h / "bin" / "nvcc").exists() and (h / "include" / "cuda_runtime_api.h").exists() \
                and (h / "lib64" / "libcudart_static.a").exists():
            return h / "bin" / "nvcc", h
    return None


def sources(*dirs, suffix):
    return sorted(str(p) for d in dirs for p in (CSRC / d).glob(f"*{suffix}"))


def ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


class NinjaBuildExt(build_ext):
    """Writes build.ninja into the temp dir, runs ninja, copies the module where setuptools wants it."""

    def build_extension(self, ext):
        import pybind11

        found = find_cuda()
        with_cuda = found is not None
        nvcc, cuda_home = found if with_cuda else (None, None)
        archs = [a.strip() for a in os.environ.get("COLOMEM_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
                 if a.strip()]
        sanitize = os.environ.get("COLOMEM_SANITIZE", "").strip()
        debug = os.environ.get("COLOMEM_DEBUG", "0") not in ("", "0")
        version = read_version()

        build_dir = Path(self.build_temp).resolve() / ("cuda" if with_cuda else "host") / (sanitize or "plain")
        build_dir.mkdir(parents=True, exist_ok=True)
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_path.parent.mkdir(parents=True, exist_ok=True)

        defines = [f'-DCOLOMEM_VERSION="{version}"', f"-DCOLOMEM_SANITIZERS=\"{sanitize}\""]
        if with_cuda:
            defines += ["-DCOLOMEM_WITH_CUDA=1", f'-DCOLOMEM_CUDA_ARCHS="{";".join(archs)}"']
        includes = [f"-I{CSRC}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
        if with_cuda:
            includes.append(f"-I{cuda_home / 'include'}")
        opt = ["-O0", "-g"] if debug else ["-O2", "-g"]
        cxxflags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
                    *opt, *defines, *includes]
        ldflags = ["-shared", "-pthread"]
        if sanitize:
            san = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
            cxxflags += san
            ldflags += san
        libs = ["-ldl", "-lrt"]
        if with_cuda:
            libs = [str(cuda_home / "lib64" / "libcudart_static.a"), *libs]

        cpp = sources("core", "bindings", suffix=".cpp")
        cpp += sources("cuda", suffix=".cpp") if with_cuda else sources("host_only", suffix=".cpp")
        cu = sources("cuda", suffix=".cu") if with_cuda else []
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        if archs:
            top = max(archs, key=int)
            gencode += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
        nvccflags = ["-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                     *defines, *includes, *gencode]

        cxx = os.environ.get("CXX", "c++")
        q = " ".join
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
            f"cxxflags = {q(shlex.quote(f) for f in cxxflags)}",
            f"ldflags = {q(ldflags)}",
            f"libs = {q(shlex.quote(x) for x in libs)}",
            "rule cxx",
            "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = CXX $in",
            "rule link",
            "  command = $cxx $in -o $out $ldflags $libs",
            "  description = LINK $out",
        ]
        if with_cuda:
            lines += [
                f"nvcc = {nvcc}",
                f"nvccflags = {q(shlex.quote(f) for f in nvccflags)}",
                "rule nvcc",
                "  command = $nvcc -MD -MF $out.d $nvccflags -c $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                "  description = NVCC $in",
            ]
        objects = []
        for src in cpp + cu:
            rel = Path(src).relative_to(CSRC)
            obj = build_dir / (str(rel).replace("/", "__") + ".o")
            rule = "nvcc" if src.endswith(".cu") else "cxx"
            lines.append(f"build {ninja_escape(str(obj))}: {rule} {ninja_escape(src)}")
            objects.append(ninja_escape(str(obj)))
        so = build_dir / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
        lines.append(f"build {ninja_escape(str(so))}: link {' '.join(objects)}")
        lines.append(f"default {ninja_escape(str(so))}")
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")

        kind = f"CUDA (nvcc {nvcc}, archs {';'.join(archs)})" if with_cuda else "host-only (no nvcc found" + (
            ", COLOMEM_FORCE_CPU set)" if os.environ.get("COLOMEM_FORCE_CPU", "0") not in ("", "0") else ")")
        print(f"colomem: building colomem._C {version}: {kind}"
              + (f", sanitizers {sanitize}" if sanitize else ""), file=sys.stderr, flush=True)
        ninja = shutil.which("ninja")
        if ninja is None:
            import ninja as ninja_pkg  # the pip package ships the binary

            ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        cmd = [ninja, "-C", str(build_dir)]
        if os.environ.get("MAX_JOBS"):
            cmd += ["-j", os.environ["MAX_JOBS"]]
        subprocess.run(cmd, check=True)
        shutil.copyfile(so, out_path)
        (out_path.parent / "_build_kind.txt").write_text(kind + "\n")


setup(
    version=read_version(),
    ext_modules=[Extension("colomem._C", sources=[])],
    cmdclass={"build_ext": NinjaBuildExt},
)
