"The tinycomp console script: command discovery, the one error path, help texts, and the commands end to end."
import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import tinycomp
from tinycomp.cli import build_parser, command_modules, main
from tinycomp.models import MODELS
from tinycomp.profiling.timing import threads_arg, usable_cores

REPO = Path(__file__).resolve().parents[1]


def run(*args, **kw):
    return subprocess.run([sys.executable, '-m', 'tinycomp.cli', *args], capture_output=True, text=True, timeout=600, **kw)


def commands(parser):
    "{name: subparser} of the first level of `parser`."
    return dict(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def walk(parser, prefix=()):
    "(command path, parser) for every command and sub-command under `parser`."
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from walk(sub, prefix + (name,))


def test_version_and_help(capsys):
    assert main(['--version']) == 0
    assert tinycomp.__version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ('tour', 'train', 'bench', 'test', 'status', 'release', 'refs', 'grade'):
        assert command in out
    assert main(['--help']) == 0


def test_console_script_is_installed():
    result = subprocess.run(['tinycomp', '--version'], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and tinycomp.__version__ in result.stdout


# --- discovery -------------------------------------------------------------------------------------------

def test_every_add_cli_module_is_found_and_registered():
    found = command_modules()
    names = [m.__name__ for m in found]
    assert {'tinycomp.tour', 'tinycomp.conv', 'tinycomp.models'} <= set(names)
    assert any(n == 'tinycomp.course' or n.startswith('tinycomp.course.') for n in names), names
    assert 'tinycomp.cli' not in names and not any(part.startswith('_') for n in names for part in n.split('.'))
    # reading the source first finds exactly what importing every module finds
    assert names == [m.__name__ for m in command_modules(scan_source=False)]
    registered = commands(build_parser())
    bench = commands(registered['bench'])
    for module in found:  # every command of every add_cli / add_bench_cli module is in the real parser
        alone = argparse.ArgumentParser()
        if 'add_cli' in vars(module):
            module.add_cli(alone.add_subparsers())
            assert set(commands(alone)) <= set(registered), module.__name__
        else:
            module.add_bench_cli(alone.add_subparsers())
            assert commands(alone) and set(commands(alone)) <= set(bench), module.__name__
    assert 'tinycomp.quantization.analysis' in names and 'quant' in bench
    assert list(registered)[:4] == ['tour', 'bench', 'profile', 'train']  # CLI_ORDER: tour, measuring, profiling, training, course


def test_commands_live_where_they_belong():
    registered = commands(build_parser())
    assert registered['tour'].get_default('func').__module__ == 'tinycomp.tour'
    assert registered['train'].get_default('func').__module__ == 'tinycomp.models'
    bench_sub = commands(registered['bench'])
    assert {'conv', 'train'} <= set(bench_sub) and bench_sub['conv'].get_default('func').__module__ == 'tinycomp.conv'   # via add_bench_cli
    assert bench_sub['train'].get_default('func').__module__ == 'tinycomp.models'                                    # via add_bench_cli
    assert list(bench_sub)[:2] == ['conv', 'train']   # the modules' CLI_ORDER
    assert bench_sub['quant'].get_default('func').__module__ == 'tinycomp.quantization.analysis'   # via add_bench_cli


def test_cli_registers_bench_conv_and_train():
    parser = build_parser()
    args = parser.parse_args(['bench', 'conv', '--threads', '1', '--json', 'out.json', '--repeats', '5', '--no-torch'])
    assert (args.threads, args.json, args.repeats, args.no_torch) == (1, 'out.json', 5, True) and callable(args.func)
    args = parser.parse_args(['bench', 'train', '--epochs', '2', '--runs', '1'])
    assert (args.epochs, args.runs, args.threads) == (2, 1, None) and callable(args.func)


@pytest.mark.parametrize('argv', [['bench', 'conv', '--repeats', '0'], ['bench', 'train', '--epochs', '0'],
                                  ['bench', 'train', '--runs', '-1']])
def test_counts_below_one_are_argparse_errors(argv, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and 'at least 1' in capsys.readouterr().err


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_discovery_walks_subpackages_skips_private_modules_and_survives_broken_ones(tmp_path, monkeypatch, capsys):
    extra = tmp_path / 'extra'
    _write(extra / 'zzfake_pkg' / '__init__.py', 'from .cmds import add_cli  # a re-export, not a definition\n')
    _write(extra / 'zzfake_pkg' / 'cmds.py', "CLI_ORDER = 5\n"
           "def add_cli(sub):\n    p = sub.add_parser('zzfake', help='h', description='d')\n"
           "    p.set_defaults(func=lambda a: 7)\n")
    _write(extra / '_zzprivate.py', "def add_cli(sub): sub.add_parser('zzprivate')\n")
    _write(extra / 'zzbroken.py', "import no_such_module_anywhere\ndef add_cli(sub): sub.add_parser('zzbroken')\n")
    _write(extra / 'zzplain.py', "x = 1\n")
    monkeypatch.setattr(tinycomp, '__path__', [*tinycomp.__path__, str(extra)])
    try:
        names = [m.__name__ for m in command_modules()]
        assert 'tinycomp.zzfake_pkg.cmds' in names and names[0] == 'tinycomp.zzfake_pkg.cmds'  # CLI_ORDER 5 comes first
        assert not any('zzprivate' in n or 'zzbroken' in n or 'zzplain' in n or n == 'tinycomp.zzfake_pkg' for n in names)
        assert 'tinycomp.zzplain' not in sys.modules  # a module without add_cli is not imported
        assert 'commands of tinycomp.zzbroken are unavailable' in capsys.readouterr().err
        assert main(['zzfake']) == 7
        assert list(commands(build_parser()))[0] == 'zzfake'
    finally:
        for name in [n for n in sys.modules if 'zzfake' in n or 'zzbroken' in n or 'zzplain' in n]: del sys.modules[name]
        for attr in ('zzfake_pkg', 'zzbroken', 'zzplain'):
            if hasattr(tinycomp, attr): delattr(tinycomp, attr)


def test_every_command_and_argument_is_described():
    seen = set()
    for path, parser in walk(build_parser()):
        seen.add(path)
        assert parser.description and len(parser.description) > 40, path
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)): continue
            assert action.help, (path, action.dest)
    assert {('tour',), ('train',), ('bench',), ('bench', 'conv'), ('bench', 'train')} <= seen


def test_every_threads_option_uses_the_shared_validation():
    options = [(path, a) for path, p in walk(build_parser()) for a in p._actions if '--threads' in a.option_strings]
    assert {path for path, _ in options} >= {('tour',), ('bench', 'conv'), ('bench', 'train')}
    assert all(a.type is threads_arg for _, a in options)


def test_model_names_come_from_the_registry():
    train = commands(build_parser())['train']
    name = next(a for a in train._actions if a.dest == 'name')
    assert name.choices == sorted(MODELS)


# --- the one error path ----------------------------------------------------------------------------------

def test_a_tinycomp_error_is_one_line_and_exit_code_2(tmp_path, capsys):
    not_a_dir = tmp_path / 'file'
    not_a_dir.write_text('')
    assert main(['tour', '--out', str(not_a_dir), '--no-progress']) == 2
    err = capsys.readouterr().err
    assert err.startswith('tinycomp: error: ') and 'not a directory' in err
    assert 'Traceback' not in err and len(err.strip().splitlines()) == 1


def test_a_tinycomp_error_raised_in_any_command_goes_through_main(monkeypatch, capsys):
    from tinycomp.errors import TinycompError
    def fail(*a, **k): raise TinycompError('something the user did wrong')
    monkeypatch.setattr(importlib.import_module('tinycomp.models'), 'train_command', fail)
    assert main(['train', 'digits_cnn']) == 2
    assert capsys.readouterr().err == 'tinycomp: error: something the user did wrong\n'


def test_ctrl_c_is_exit_code_130(monkeypatch, capsys):
    def interrupt(*a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module('tinycomp.tour'), 'tour', interrupt)
    assert main(['tour']) == 130
    assert capsys.readouterr().err == 'tinycomp: interrupted\n'


@pytest.mark.parametrize('command', [['tour'], ['bench', 'conv'], ['bench', 'train']])
@pytest.mark.parametrize('threads', ['0', '-3', 'cores+1'])
def test_bad_thread_counts_are_refused_in_one_line(command, threads, capsys):
    cores = usable_cores()
    value = str(cores + 1) if threads == 'cores+1' else threads
    assert main([*command, '--threads', value]) == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and 'error: argument --threads:' in err
    if threads == 'cores+1': assert f"this machine has {cores} core" in err
    else: assert f"at least 1, got {value}" in err


def test_bad_thread_count_from_the_console_script():
    result = run('bench', 'conv', '--threads', '0')
    assert result.returncode == 2 and 'at least 1' in result.stderr and 'Traceback' not in result.stderr


# --- the commands end to end -----------------------------------------------------------------------------

def test_tour_prints_and_saves_its_figures(tmp_path):
    result = run('tour', '--out', str(tmp_path), '--no-progress', '--threads', '1')
    assert result.returncode == 0, result.stderr
    for label in ('latency measured on 1 thread', 'prune_channels', 'distill', 'quantize_static', 'b64 speedup [95% CI]',
                  'ECE', 'critical failures', 'x smaller', 'x faster', 'McNemar p'):
        assert label in result.stdout, label
    for name in ('training_curve.png', 'compression_report.png', 'critical_failures.png'):
        assert (tmp_path / name).stat().st_size > 1000
    report = json.loads((tmp_path / 'compression_report.json').read_text())
    from tinycomp.data import load_digits
    from tinycomp.io import load
    from tinycomp.tensor import Tensor
    model = load(tmp_path / 'digits_cnn_wide_compressed.npz')
    assert [r['stage'] for r in report['rows']] == ['original', 'prune_channels', 'distill', 'quantize_static']
    assert report['rows'][-1]['file_bytes'] == (tmp_path / 'digits_cnn_wide_compressed.npz').stat().st_size
    assert model(Tensor(load_digits('test')[0][:2])).shape == (2, 10)


def test_train_writes_a_loadable_model(tmp_path):
    result = run('train', 'digits_cnn', '--epochs', '1', '--out', str(tmp_path), '--no-progress')
    assert result.returncode == 0, result.stderr
    from tinycomp.io import load
    load(tmp_path / 'digits_cnn.npz')
    info = json.loads((tmp_path / 'digits_cnn.json').read_text())
    assert info['parameters'] == 9_930 and len(info['history']['epoch']) == 1


def test_bad_arguments_are_argparse_errors():
    result = run('train', 'no_such_model')
    assert result.returncode == 2 and 'invalid choice' in result.stderr and 'digits_cnn_wide' in result.stderr
    result = run('train', 'digits_cnn', '--epochs', '0')
    assert result.returncode == 2 and 'at least 1' in result.stderr and 'Traceback' not in result.stderr


def test_tour_output_is_git_ignored():
    lines = (REPO / '.gitignore').read_text().splitlines()
    assert 'tinycomp_tour/' in lines
    if (REPO / '.git').exists():
        assert subprocess.run(['git', 'check-ignore', '-q', 'tinycomp_tour/digits_cnn.npz'], cwd=REPO).returncode == 0
