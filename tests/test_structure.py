"""House rules a newcomer can rely on: one concept a file (no package file over 600 lines), no import cycle, no import
from a higher floor of the layering, and nothing internal (issue numbers, design notes) in what learners read."""
import ast, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'tinycomp'

# Bottom to top; a file imports only from its own floor or below. Siblings on one floor may import each other
# where a technique composes, but never in a cycle. The timer of module 03 sits at the bottom: every measurement of
# the course goes through it, the benchmarks of modules 02 and of training included.
FLOORS = [('tinycomp', 'tinycomp.errors', 'tinycomp.lazy', 'tinycomp.files', 'tinycomp.profiling.timing'),
          ('tinycomp.tensor',),
          ('tinycomp.nn', 'tinycomp.optim'),
          ('tinycomp.conv', 'tinycomp.pooling', 'tinycomp.batchnorm', 'tinycomp.tiles'),
          ('tinycomp.graph',),
          ('tinycomp.data', 'tinycomp.io', 'tinycomp.models'),
          ('tinycomp.profiling',),
          ('tinycomp.quantization', 'tinycomp.pruning', 'tinycomp.distillation'),
          ('tinycomp.benchmarking', 'tinycomp.onnx', 'tinycomp.deploy'),
          ('tinycomp.leaderboard',),
          ('tinycomp.course', 'tinycomp.checks', 'tinycomp.tour', 'tinycomp.cli')]


def package_modules(root=PACKAGE) -> dict:
    "`{dotted name: path}` of every module of the package (the generated index aside)."
    out = {}
    for p in root.rglob('*.py'):
        if p.name == '_modidx.py': continue
        name = '.'.join(p.relative_to(root.parent).with_suffix('').parts)
        out[name[:-len('.__init__')] if name.endswith('.__init__') else name] = p
    return out


def imports_of(name, path, modules) -> list:
    "`(imported module, line)` for every import of a package module in `path`, inside functions too."
    package = name if path.name == '__init__.py' else name.rsplit('.', 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)): base = base.rsplit('.', 1)[0]
            target = (base + ('.' + node.module if node.module else '')) if node.level else (node.module or '')
            candidates = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import): candidates = [a.name for a in node.names]
        else: continue
        for t in candidates:
            while t and t not in modules: t = t.rsplit('.', 1)[0] if '.' in t else ''
            if t and t != name: out.append((t, node.lineno)); break
    return out


def floor(name):
    found = [(i, len(p)) for i, f in enumerate(FLOORS) for p in f if name == p or name.startswith(p + '.')]
    return max(found, key=lambda x: x[1])[0] if found else None


def test_no_package_file_holds_more_than_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding='utf-8').splitlines()) for p in package_modules().values()}
    big = {p: n for p, n in sizes.items() if n > 600}
    assert not big, f"split these into one file per concept (one notebook per file): {big}"


def test_no_import_cycle_between_package_files():
    modules = package_modules()
    graph = {m: sorted({t for t, _ in imports_of(m, p, modules)}) for m, p in modules.items()}
    state, cycles = {}, []
    def visit(m, stack):
        state[m] = 'open'
        for d in graph[m]:
            if state.get(d) == 'open': cycles.append(' -> '.join(stack[stack.index(d):] + [d]))
            elif d not in state: visit(d, stack + [d])
        state[m] = 'done'
    for m in sorted(graph):
        if m not in state: visit(m, [m])
    assert not cycles, cycles


def test_no_file_imports_from_a_floor_above_it():
    modules = package_modules()
    assert all(floor(m) is not None for m in modules), [m for m in modules if floor(m) is None]
    wrong = [f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)}), line {line}"
             for m, p in modules.items() for t, line in imports_of(m, p, modules) if floor(t) > floor(m)]
    assert not wrong, wrong


def test_the_checks_catch_a_cycle_and_a_floor_violation(tmp_path):
    "The two tests above can fail: a small package with a cycle and an import from above."
    pkg = tmp_path / 'tinycomp'; (pkg / 'nn').mkdir(parents=True)
    (pkg / '__init__.py').write_text('')
    (pkg / 'tensor.py').write_text('from .nn import modules\n')               # floor 1 imports floor 2
    (pkg / 'nn' / '__init__.py').write_text('')
    (pkg / 'nn' / 'modules.py').write_text('def f():\n    from ..tensor import x\n')   # and back: a cycle
    modules = package_modules(pkg)
    edges = {m: [t for t, _ in imports_of(m, p, modules)] for m, p in modules.items()}
    assert edges['tinycomp.tensor'] == ['tinycomp.nn.modules'] and edges['tinycomp.nn.modules'] == ['tinycomp.tensor']
    assert floor('tinycomp.nn.modules') > floor('tinycomp.tensor')


INTERNAL = re.compile(r'[Ii]ssues? #?\d+|DESIGN(\.md| ?§)|\b(our|one of our) anchors?\b|shared/DESIGN|DEVELOPERS\.md')

def _learner_texts():
    for folder in ('nbs', 'modules', 'tinycomp'):
        for p in (ROOT / folder).rglob('*'):
            if p.suffix in ('.ipynb', '.py', '.md') and p.name != '_modidx.py': yield p
    yield ROOT / 'README.md'


def test_nothing_internal_in_what_learners_and_instructors_read():
    "No issue numbers, design-note sections or 'anchors' in notebooks, student notebooks, the package or the README."
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in _learner_texts()
             for m in INTERNAL.finditer(p.read_text(encoding='utf-8', errors='replace'))]
    assert not found, "say the point in the course's own words: " + '; '.join(found[:10])


@pytest.mark.parametrize('text', ['see issue 12', 'the trap in DESIGN §9', 'one of our anchors fell into it', '(DESIGN.md)'])
def test_the_internal_reference_pattern_finds_what_it_should(text):
    assert INTERNAL.search(text)
    assert not INTERNAL.search('text-anchor="middle"') and not INTERNAL.search('an issue with the input')


@pytest.mark.parametrize('namespace', ['nn', 'nn.functional', 'profiling', 'pruning', 'quantization', 'benchmarking', 'onnx',
                                       'leaderboard'])
def test_every_name_a_namespace_lists_exists(namespace):
    "A name renamed or removed in a part is not left behind in the namespace that re-exports it."
    import importlib
    ns = importlib.import_module(f"tinycomp.{namespace}")
    missing = []
    for name in dir(ns):
        try: getattr(ns, name)
        except AttributeError: missing.append(name)
    assert not missing, f"tinycomp.{namespace} lists names its parts no longer define: {missing}"
