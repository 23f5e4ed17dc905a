"The tinycomp console script: its commands found through entry points, the one error path, help texts, and the commands end to end."
import argparse
import configparser
import importlib
import json
import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import tinycomp
import tinycomp.cli as cli
from tinycomp.cli import BENCHMARKS, COMMANDS, build_parser, main, registered
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


# --- discovery: entry points ------------------------------------------------------------------------------

def settings_entry_points() -> dict:
    "{group: {name: 'module:function'}} as settings.ini lists them (setup.py installs them under these groups)."
    cfg = configparser.ConfigParser(delimiters=['='])
    cfg.read(REPO / 'settings.ini', encoding='utf-8')
    return {group: dict(ep.split('=', 1) for ep in cfg['DEFAULT'][key].split())
            for group, key in ((COMMANDS, 'commands'), (BENCHMARKS, 'bench_commands'))}


def registering_functions() -> set:
    "'module:function' of every top-level `def add_...cli(` in the package's sources."
    found = set()
    for path in (REPO / 'tinycomp').rglob('*.py'):
        module = '.'.join(path.relative_to(REPO).with_suffix('').parts).removesuffix('.__init__')
        for name in re.findall(r'^def (add_\w*cli)\s*\(', path.read_text(encoding='utf-8'), re.M):
            found.add(f"{module}:{name}")
    return found


def test_every_registering_function_is_an_entry_point_and_installed():
    listed = settings_entry_points()
    values = {v for eps in listed.values() for v in eps.values()}
    assert registering_functions() - values == set(), "add these to settings.ini (commands or bench_commands)"
    assert 'tinycomp.course.cli:add_test_cli' in values and 'tinycomp.conv:add_bench_cli' in values
    for group, eps in listed.items():
        installed = {name: ep.value for name, ep in registered(group).items()}
        assert installed == eps, f"the installed {group} entry points differ from settings.ini: run pip install -e . again"
        for value in eps.values():
            module, function = value.split(':')
            assert callable(getattr(importlib.import_module(module), function)), value


def test_commands_are_registered_alphabetically_each_by_its_own_entry_point():
    registered_ = commands(build_parser())
    assert list(registered_) == sorted(settings_entry_points()[COMMANDS])
    assert list(commands(registered_['bench'])) == sorted(settings_entry_points()[BENCHMARKS])
    for group in (COMMANDS, BENCHMARKS):
        for name, ep in registered(group).items():          # each function registers exactly its own command
            sub = argparse.ArgumentParser().add_subparsers()
            ep.load()(sub)
            assert list(sub.choices) == [name], ep.value


def test_commands_live_where_they_belong():
    registered_ = commands(build_parser())
    assert registered_['tour'].get_default('func').__module__ == 'tinycomp.tour'
    assert registered_['train'].get_default('func').__module__ == 'tinycomp.models'
    bench_sub = commands(registered_['bench'])
    assert {'conv', 'train'} <= set(bench_sub) and bench_sub['conv'].get_default('func').__module__ == 'tinycomp.conv'   # via add_bench_cli
    assert bench_sub['train'].get_default('func').__module__ == 'tinycomp.models'                                    # via add_bench_cli
    assert bench_sub['quant'].get_default('func').__module__ == 'tinycomp.quantization.analysis'   # via add_bench_cli


@pytest.mark.parametrize('argv', [[name, '--help'] for name in sorted(settings_entry_points()[COMMANDS])]
                                 + [['bench', name, '--help'] for name in sorted(settings_entry_points()[BENCHMARKS])])
def test_every_command_and_benchmark_has_a_working_help(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tinycomp {' '.join(argv[:-1])}"), out[:200]


def test_running_a_command_imports_only_its_module():
    code = ("import sys\nfrom tinycomp.cli import main\nassert main(['test', '--help']) == 0\n"
            "print(sorted(m for m in sys.modules if m.startswith(('tinycomp.leaderboard', 'tinycomp.onnx', 'tinycomp.quantization'))))")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == '[]', result.stdout
    result = run('test', '--help')
    assert result.returncode == 0 and result.stdout.startswith('usage: tinycomp test')
    result = run('--help')                                 # the full list, with the first step for a newcomer
    assert result.returncode == 0 and 'Start with `tinycomp tour`' in ' '.join(result.stdout.split())
    for name in settings_entry_points()[COMMANDS]:
        assert re.search(rf'^    {name}\b', result.stdout, re.M), name


def test_build_parser_loads_what_argv_names():
    assert list(commands(build_parser(['test', '--help']))) == ['test']
    p = build_parser(['bench', 'quant', '--repeats', '3'])
    assert list(commands(p)) == ['bench'] and list(commands(commands(p)['bench'])) == ['quant']
    everything = list(commands(build_parser()))
    for argv in ([], ['--help'], ['--version'], ['no_such_command']):
        assert list(commands(build_parser(argv))) == everything, argv
    assert list(commands(commands(build_parser(['bench', '--help']))['bench'])) == sorted(registered(BENCHMARKS))


def _fake_entry_points(tmp_path, monkeypatch, extra):
    "Make tinycomp.cli see the real entry points plus `extra` {(group, name): 'module:function'}; fake modules in tmp_path."
    _write(tmp_path / 'zz_cli_fakes.py',
           "def add_good(sub):\n    p = sub.add_parser('zzgood', help='h', description='d')\n    p.set_defaults(func=lambda a: 7)\n"
           "def add_none(sub): pass\n"
           "def add_other(sub): sub.add_parser('zzsomething_else')\n"
           "def add_bench(sub):\n    p = sub.add_parser('zzbench', help='h', description='d')\n    p.set_defaults(func=lambda a: 5)\n")
    _write(tmp_path / 'zz_cli_broken.py', "import no_such_module_anywhere\ndef add_cli(sub): sub.add_parser('zzbroken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = cli.entry_points
    def fake(group):
        return [*real(group=group)] + [EntryPoint(name, value, g) for (g, name), value in extra.items() if g == group]
    monkeypatch.setattr(cli, 'entry_points', fake)


def test_a_broken_entry_point_warns_and_the_others_work(tmp_path, monkeypatch, capsys):
    _fake_entry_points(tmp_path, monkeypatch, {(COMMANDS, 'zzbroken'): 'zz_cli_broken:add_cli',
                                               (COMMANDS, 'zzgood'): 'zz_cli_fakes:add_good',
                                               (BENCHMARKS, 'zzbench'): 'zz_cli_fakes:add_bench',
                                               (BENCHMARKS, 'zzbrokenbench'): 'zz_cli_broken:add_cli'})
    assert main(['--help']) == 0
    out, err = capsys.readouterr()
    assert 'zzgood' in out and 'tour' in out and 'zzbroken' not in out
    assert len(err.splitlines()) == 2 and "tinycomp: warning: `tinycomp zzbroken` is unavailable: zz_cli_broken:add_cli" in err
    assert "`tinycomp bench zzbrokenbench` is unavailable" in err and 'no_such_module_anywhere' in err
    assert main(['zzgood']) == 7 and capsys.readouterr().err == ''          # only what runs is loaded: no warning
    assert main(['bench', 'zzbench']) == 5 and capsys.readouterr().err == ''
    assert main(['zzbroken']) == 2                                          # the broken one itself: warned, then argparse lists the rest
    err = capsys.readouterr().err
    assert 'is unavailable' in err and "invalid choice: 'zzbroken'" in err and 'tour' in err
    assert main(['status', '--brief']) == 0


@pytest.mark.parametrize('function, words', [('add_none', 'registered no command'),
                                             ('add_other', "registered 'zzsomething_else'")])
def test_an_entry_point_must_register_its_own_name(function, words, tmp_path, monkeypatch, capsys):
    _fake_entry_points(tmp_path, monkeypatch, {(COMMANDS, 'zzwrong'): f'zz_cli_fakes:{function}'})
    assert main(['zzwrong']) == 2
    err = capsys.readouterr().err
    assert err.startswith('tinycomp: error: entry point zzwrong = zz_cli_fakes:') and words in err and len(err.splitlines()) == 1


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

@pytest.mark.slow
def test_tour_prints_and_saves_its_figures(writes_only):
    result = run('tour', '--no-progress', '--threads', '1', cwd=writes_only.cwd)     # the default --out, tinycomp_tour
    assert result.returncode == 0, result.stderr
    assert writes_only.check(result.stdout, 'tinycomp_tour') == [
        f'tinycomp_tour/{n}' for n in ('compression_report.json', 'compression_report.png', 'critical_failures.png',
                                       'digits_cnn_wide_compressed.npz', 'training_curve.png')]
    tmp_path = writes_only.cwd / 'tinycomp_tour'
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


@pytest.mark.slow
def test_train_writes_a_loadable_model(writes_only):
    result = run('train', 'digits_cnn', '--epochs', '1', '--no-progress', cwd=writes_only.cwd)   # --out tinycomp_train
    assert result.returncode == 0, result.stderr
    assert writes_only.check(result.stdout, 'tinycomp_train') == ['tinycomp_train/digits_cnn.json', 'tinycomp_train/digits_cnn.npz']
    tmp_path = writes_only.cwd / 'tinycomp_train'
    from tinycomp.io import load
    load(tmp_path / 'digits_cnn.npz')
    info = json.loads((tmp_path / 'digits_cnn.json').read_text())
    assert info['parameters'] == 9_930 and len(info['history']['epoch']) == 1


def test_bad_arguments_are_argparse_errors():
    result = run('train', 'no_such_model')
    assert result.returncode == 2 and 'invalid choice' in result.stderr and 'digits_cnn_wide' in result.stderr
    result = run('train', 'digits_cnn', '--epochs', '0')
    assert result.returncode == 2 and 'at least 1' in result.stderr and 'Traceback' not in result.stderr


def out_defaults() -> dict:
    "{command path: default of its --out} of every command with an --out option."
    return {path: a.default for path, p in walk(build_parser()) for a in p._actions if '--out' in a.option_strings}


def test_every_out_is_a_folder_named_after_its_command_and_git_ignored():
    defaults = out_defaults()
    assert {('tour',), ('profile',), ('compress',), ('train',), ('export',), ('import',), ('bench', 'strategies')} <= set(defaults)
    for path, default in defaults.items():
        assert default == f"tinycomp_{path[0]}", (path, default)
        option = next(a for p_, p in walk(build_parser()) if p_ == path for a in p._actions if '--out' in a.option_strings)
        assert option.metavar == 'DIR' and 'folder' in option.help, path
    assert 'tinycomp_*/' in (REPO / '.gitignore').read_text().splitlines()
    if (REPO / '.git').exists():
        for default in set(defaults.values()):
            assert subprocess.run(['git', 'check-ignore', '-q', f'{default}/x.npz'], cwd=REPO).returncode == 0, default


@pytest.mark.parametrize('argv, target', [
    (['bench', 'conv', '--no-torch'], 'tinycomp.conv.conv_benchmark'),
    (['bench', 'train', '--no-torch'], 'tinycomp.models.train_benchmark'),
    (['bench', 'prune'], 'tinycomp.pruning.schedules.prune_benchmark'),
    (['bench', 'quant'], 'tinycomp.quantization.analysis.quant_benchmark'),
    (['bench', 'onnx'], 'tinycomp.onnx.cli.onnx_benchmark')])
def test_a_benchmark_writes_only_its_json_and_says_so(argv, target, writes_only, monkeypatch, capsys):
    "The benchmarks themselves are measured in their own tests; here: --json FILE is the one file, and it is printed."
    from tinycomp.files import write_json
    monkeypatch.setattr(target, lambda json_path=None, **kw: write_json({'fake': True}, json_path) if json_path else None)
    assert main([*argv, '--json', 'results.json']) == 0
    assert writes_only.check(capsys.readouterr().out, 'results.json') == ['results.json']
    assert main(argv) == 0 and writes_only.files() == {'results.json'}      # nothing without --json
