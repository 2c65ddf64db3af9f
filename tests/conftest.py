"""Shared test setup: 8 fake CPU devices (set before jax is imported), offline tiktoken, and text to train on."""

import contextlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

# 8 fake devices, for the sharded tests. XLA's bounds on a collective's wait stay its own: a collective stuck past
# them is a deadlock to find, and waiting longer only delays the abort.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLIs keep a persistent compilation cache in the user's cache directory: tests' runs keep theirs apart.
CACHE_HOME = tempfile.mkdtemp(prefix="gpt-test-cache-")
os.environ["XDG_CACHE_HOME"] = CACHE_HOME

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
if (SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))

import pytest  # noqa: E402


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


# The instruction sets of the compiled CPU kernels (`gpt.model.cpu_kernels`) this CPU has, lowest first.
KERNEL_ISAS = [isa for isa, flags in (("avx2", {"avx2", "fma"}), ("avx512_vnni", {"avx512f", "avx512bw", "avx512_vnni"}))
               if flags <= _cpu_flags()]


@contextlib.contextmanager
def kernels_on(isa: str):
    """The compiled CPU kernels kept to `isa` within (skipped where they are not built)."""
    from gpt.model import cpu_kernels

    if cpu_kernels.isa() is None:
        pytest.skip("the CPU kernels are not built here")
    assert cpu_kernels.limit_isa(isa) == isa
    try:
        yield isa
    finally:
        cpu_kernels.limit_isa(KERNEL_ISAS[-1])


@pytest.fixture(params=["xla", *KERNEL_ISAS])
def attention_path(request, monkeypatch):
    """A decode step's attention through XLA's ops, then the kernel on each instruction set the CPU has (chosen
    when a function is traced: trace afresh under each)."""
    if request.param == "xla":
        from gpt.model import cpu_kernels

        monkeypatch.setattr(cpu_kernels, "isa", lambda: None)
        yield "xla"
        return
    with kernels_on(request.param):
        yield request.param


@pytest.fixture(params=KERNEL_ISAS)
def kernel_isa(request):
    """Each instruction set of the compiled CPU kernels this CPU has, in turn."""
    with kernels_on(request.param):
        yield request.param


def some_quick(cases: list, quick: list) -> list:
    """`cases` as pytest parameters, each not in `quick` marked slow: the quick tier checks a few of the
    shapes a check covers (chosen to reach each of its branches), the full suite every one."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=() if case in quick else pytest.mark.slow)
            for case in cases]


def pytest_configure(config):
    """The quick tier (`-m "not slow"`) compiles without LLVM's optimizations: its tests compile far more
    than they run, and it takes about a fifth less time so, where the slow tests' whole training runs step
    ~1.7x slower. The full suite, what CI runs, keeps XLA's defaults: every program is tested as a user
    compiles it. Set here, before any test module imports jax."""
    if config.option.markexpr.replace(" ", "") == "notslow":
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


# Each module's seconds in the last full run that passed: the modules run longest first, so that both workers
# end together. Each of the two workers takes the next module (or family, below) when it frees up (xdist's
# loadscope, with --no-loadscope-reorder), so a long module that came last ran on alone. A module not recorded
# yet runs first, its time unknown. The suite records its own runs in pytest's cache (`pytest_sessionfinish`,
# under DURATIONS_KEY, in the ignored .pytest_cache); DURATIONS, a tracked file, is the order a fresh clone
# starts from, written only on purpose (`pytest --record-durations`).
DURATIONS = Path(__file__).with_name("durations.json")
DURATIONS_KEY = "gpt/durations"


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="after a full run that passes, write each module's seconds to tests/durations.json")

# Modules that compile the same programs (the same model and engine shapes) run on one worker, back to back,
# as one unit of work, the first module naming it: the server modules' servers warm up once between them
# (on two workers, ~15 s of compiling again).
FAMILY = {"test_serve_faults": "test_serve", "test_prefix_cache": "test_engine"}


def family(module: str) -> str:
    """The unit of work a test module (its file's stem) belongs to."""
    return FAMILY.get(module, module)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: no error where xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope, with a family of modules as one scope."""
    from xdist.scheduler import LoadScopeScheduling

    class FamilyScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return family(Path(super()._split_scope(nodeid)).stem)

    return FamilyScheduling(config, log)


def recorded_durations(config=None) -> dict[str, float]:
    """{module: seconds}: this checkout's last full run (pytest's cache, when `config` has one), else DURATIONS;
    empty when neither is there or readable."""
    cached = config.cache.get(DURATIONS_KEY, None) if getattr(config, "cache", None) is not None else None
    if isinstance(cached, dict):
        return cached
    try:
        durations = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return durations if isinstance(durations, dict) else {}


def pytest_collection_modifyitems(config, items):
    """Orders the families of modules longest first by their recorded seconds (unrecorded ones first), each
    family's modules together, keeping each module's tests in their order."""
    durations, seconds = recorded_durations(config), {}
    for name in {item.path.stem for item in items}:
        seconds[family(name)] = seconds.get(family(name), 0.0) + durations.get(name, math.inf)

    def rank(item):
        name = item.path.stem
        return -seconds[family(name)], family(name), name

    items.sort(key=rank)  # stable: a module's own order stays


_seconds: dict[str, float] = {}  # this run's seconds per module: every test's setup, call and teardown


def pytest_runtest_logreport(report):
    module = Path(report.nodeid.split("::")[0]).stem
    _seconds[module] = _seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """After a full run that passed (every module, no -k or -m), the controller records each module's
    seconds in pytest's cache for the next run's order (and in DURATIONS with --record-durations)."""
    config = session.config
    whole = (not config.option.markexpr and not config.option.keyword
             and [Path(a).resolve() for a in config.args] == [Path(config.rootpath, "tests").resolve()])
    if exitstatus == 0 and whole and not hasattr(config, "workerinput") and _seconds:
        seconds = {m: round(s, 1) for m, s in sorted(_seconds.items())}
        if getattr(config, "cache", None) is not None:
            config.cache.set(DURATIONS_KEY, seconds)
        if config.getoption("record_durations"):
            DURATIONS.write_text(json.dumps(seconds, indent=1) + "\n")


def pytest_unconfigure(config):
    """Each pytest process (the controller and every worker) removes the cache directory it made."""
    shutil.rmtree(CACHE_HOME, ignore_errors=True)


STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="session")
def corpus_text() -> str:
    """About 1.2 MB of real English-and-code text that every machine has: the running Python's
    standard-library modules, in name order (the same text on every run of one Python version)."""
    parts, size = [], 0
    for path in sorted(STDLIB.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= 1_200_000:
            break
    assert size >= 1_200_000, f"the standard library in {STDLIB} has only {size} characters of .py files"
    return "".join(parts)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, corpus_text) -> str:
    """A 200 kB text file to train on (the path, as a string)."""
    path = tmp_path_factory.mktemp("corpus") / "stdlib.txt"
    path.write_text(corpus_text[:200_000])
    return str(path)


@pytest.fixture(scope="session")
def prose_text() -> str:
    """About 465 kB of English prose that every Python has: the documentation topics behind `help()`."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


@pytest.fixture(autouse=True)
def no_persistent_cache_left_on():
    """A test that runs a CLI's main() in process must pass --no-compile_cache: once on, JAX's persistent
    cache would serialize every later test's programs (and a serialization crashed XLA once, mid-suite)."""
    yield
    import jax

    assert jax.config.jax_compilation_cache_dir is None, "this test left JAX's persistent compilation cache on"


# A test process keeps the programs it compiled from module to module (modules share the tiny models, and so
# their programs: the server modules' engines compile once) until it holds this much memory.
CACHE_BOUND_BYTES = 3 << 30


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm); None where that cannot be read."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_last_family: str | None = None  # the family of the module this process ran last


@pytest.fixture(autouse=True, scope="module")
def bounded_compile_caches(request):
    """A module of another family than the last one's starts by dropping every compiled program when the
    process is past CACHE_BOUND_BYTES (or its size cannot be read). Without a bound one pytest process
    holds every program of the suite (~6 GB by its middle), and twice in full runs XLA segfaulted while
    compiling or serializing in the last module, never when that module ran alone or after a few others."""
    import jax

    global _last_family
    this = family(request.path.stem)
    size = resident_bytes()
    if _last_family not in (None, this) and (size is None or size > CACHE_BOUND_BYTES):
        jax.clear_caches()
    _last_family = this
    yield


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus, worker_id) -> Path:
    """The directory of a training run of `training.TINY` for 150 steps on `corpus` (validation at the end,
    a checkpoint of step 150): run once per pytest run, by whichever test process asks first, and read by
    the others (a file lock in the directory the workers share). On one device: its tests are about what the
    run learned, and two devices would each update a replica of the parameters (~30% more CPU a step)."""
    from filelock import FileLock

    from training import run

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / "trained_run.lock")):
        if not (shared / "trained" / "done").exists():
            run(shared / "trained", corpus, max_steps=150, eval_interval=150, eval_iters=8, num_devices=1)
            (shared / "trained" / "done").touch()
    return shared / "trained" / "run"


@pytest.fixture(scope="module")
def model():
    """The server tests' model (`serving.decisive_model`: GPT-2's vocabulary, no greedy ties), one per module;
    a module with a `model` of its own uses that."""
    from serving import decisive_model

    return decisive_model()


@pytest.fixture(scope="module")
def server(model):
    """A server over `model` (4 slots, 16 queued, 128 positions) on an ephemeral port, one per module that
    asks (each module's own: what one module's clients do to it never reaches another's), stopped after it."""
    from serving import Server

    server = Server(model, slots=4, max_queue=16, cache_length=128)
    yield server
    server.stop()

