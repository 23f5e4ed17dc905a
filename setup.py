"Install tinycomp; all metadata lives in settings.ini (nbdev 2)."
from configparser import ConfigParser
from pathlib import Path

import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read(Path(__file__).parent / 'settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable']
lic = licenses[cfg['license']]
min_python = cfg['min_python']
py_versions = ['3.10', '3.11', '3.12', '3.13']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=(Path(__file__).parent / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=lic[0],
    url=cfg['git_url'],
    keywords=cfg['keywords'].split(),
    classifiers=[
        'Development Status :: ' + statuses[int(cfg['status']) - 1],
        'Intended Audience :: ' + cfg['audience'],
        'License :: ' + lic[1],
        'Natural Language :: ' + cfg['language'],
    ] + ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=['tinycomp', 'tinycomp.*']),
    include_package_data=True,
    package_data={'tinycomp': ['data_files/*', 'pretrained/*', 'refs/*/*']},
    install_requires=cfg['requirements'].split(),
    # learn: what a learner needs to open and run the notebooks; onnx: ONNX export/import and ONNX Runtime
    # (tinycomp.onnx); leaderboard: the web server of `tinycomp leaderboard serve` (Starlette under uvicorn);
    # site: `tinycomp site`, the course website (Sphinx with the Book theme and MyST-NB, MathJax shipped for offline
    # pages, a Jupyter kernel to run the notebooks); dev: everything, to develop and test tinycomp (CI runs every ONNX and leaderboard test; the browser test
    # drives the system's Chromium with Playwright, which is only in dev)
    extras_require={'learn': cfg['learn_requirements'].split(),
                    'onnx': cfg['onnx_requirements'].split(),
                    'leaderboard': cfg['leaderboard_requirements'].split(),
                    'site': cfg['site_requirements'].split(),
                    'dev': cfg['dev_requirements'].split() + cfg['learn_requirements'].split()
                           + cfg['onnx_requirements'].split() + cfg['leaderboard_requirements'].split()
                           + cfg['site_requirements'].split()},
    python_requires='>=' + min_python,
    zip_safe=False,
    # the console script, and every subcommand as an entry point (tinycomp.cli finds them in these groups)
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'tinycomp.commands': cfg['commands'].split(),
                  'tinycomp.bench': cfg['bench_commands'].split()},
)
