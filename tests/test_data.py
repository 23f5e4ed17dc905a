"Tests for tinycomp.data: digits, DataLoader, and checksummed downloads served from a loopback server."
import gzip
import hashlib
import io
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tinycomp import data
from tinycomp.data import (DATASETS, DIGITS_MEAN, DIGITS_STD, MNIST5K_MEAN, MNIST5K_STD, DataLoader, load_cifar10,
                           load_digits, load_fashion_mnist, load_mnist, load_mnist5k, load_shipped, load_splits, read_idx,
                           sample_shape, split_sizes, two_spirals)
from tinycomp.errors import DataError, ShapeError, TinycompError


# ---------------------------------------------------------------- helpers: files in the real formats
def idx_gz(a, magic=None):
    "Gzipped IDX bytes of uint8 array `a` (magic bytes overridable to build bad files)."
    a = np.asarray(a, dtype=np.uint8)
    head = bytes(magic) if magic is not None else bytes([0, 0, 8, a.ndim])
    return gzip.compress(head + np.array(a.shape, '>u4').tobytes() + a.tobytes())


def sha(b):
    return hashlib.sha256(b).hexdigest()


def mnist_like(n_train=7, n_test=3, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {'train-images-idx3-ubyte.gz': rng.integers(0, 256, (n_train, 28, 28)),
              'train-labels-idx1-ubyte.gz': rng.integers(0, 10, n_train),
              't10k-images-idx3-ubyte.gz': rng.integers(0, 256, (n_test, 28, 28)),
              't10k-labels-idx1-ubyte.gz': rng.integers(0, 10, n_test)}
    return arrays, {k: idx_gz(v) for k, v in arrays.items()}


def cifar_records(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(0, 10, (n, 1)), rng.integers(0, 256, (n, 3072))], 1).astype(np.uint8)


def cifar_tar(per_batch=2, members=None, seed=0, mutate=None):
    "A CIFAR-10 binary tar.gz with `per_batch` records in each batch file; returns (bytes, {member: records})."
    members = members or data.CIFAR10_MEMBERS['train'] + data.CIFAR10_MEMBERS['test']
    buf, recs = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode='w:gz') as tar:
        for i, m in enumerate(members):
            recs[m] = cifar_records(per_batch, seed + i)
            payload = recs[m].tobytes() if mutate is None else mutate(m, recs[m].tobytes())
            info = tarfile.TarInfo(m)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue(), recs


def table(files, **override):
    "A DATASETS entry whose checksums match `files` (name -> bytes), with optional (size, sha) overrides."
    t = {name: (len(b), sha(b)) for name, b in files.items()}
    t.update(override)
    return t


def leftovers(root):
    "Every file under `root` (the cache must hold nothing partial)."
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob('*') if p.is_file())


# ---------------------------------------------------------------- loopback HTTP server
class Server:
    def __init__(self, directory):
        self.directory, self.requests = Path(directory), []
        outer = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(outer.directory), **k)

            def do_GET(self):
                outer.requests.append(self.path)
                return super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.httpd.timeout = 5
        self.url = f'http://127.0.0.1:{self.httpd.server_address[1]}/'
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
        self.thread.start()

    def put(self, name, blob):
        (self.directory / name).write_bytes(blob)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server(tmp_path):
    (tmp_path / 'www').mkdir()
    s = Server(tmp_path / 'www')
    yield s
    s.stop()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / 'cache'
    monkeypatch.setenv('TINYCOMP_DATA', str(root))
    return root


def serve_mnist(server, monkeypatch, name='mnist', files=None, **override):
    arrays, blobs = mnist_like()
    blobs.update(files or {})
    for k, b in blobs.items():
        server.put(k, b)
    monkeypatch.setitem(DATASETS, name, {'base_url': server.url, 'files': table(blobs, **override)})
    return arrays, blobs


# ---------------------------------------------------------------- digits
def test_digits_shapes_classes_and_split_sizes():
    sizes = {}
    for split in ('train', 'val', 'test', 'all'):
        X, y = load_digits(split)
        assert X.dtype == np.float32 and y.dtype == np.int64
        assert X.shape == (len(y), 1, 8, 8)
        assert set(np.unique(y)) == set(range(10))
        sizes[split] = len(y)
    assert sizes == {'train': 1259, 'val': 179, 'test': 359, 'all': 1797}


def test_digits_splits_partition_the_data_and_are_stratified():
    images, labels, split = data._digits_arrays()
    assert images.dtype == np.uint8 and images.min() == 0 and images.max() == 16
    Xall = load_digits('all', normalize=False)[0]
    parts = [load_digits(s, normalize=False)[0] for s in ('train', 'val', 'test')]
    assert sum(len(p) for p in parts) == len(Xall)
    assert np.array_equal(np.sort(np.concatenate(parts).reshape(len(Xall), -1), axis=0),
                          np.sort(Xall.reshape(len(Xall), -1), axis=0))
    for c in range(10):
        n = (labels == c).sum()
        assert abs((labels[split == 2] == c).sum() - 0.2 * n) <= 1
        assert abs((labels[split == 1] == c).sum() - 0.1 * n) <= 1


def test_digits_deterministic_and_not_writable_shared_state():
    X1, y1 = load_digits('train')
    X1[:] = 0  # the caller owns its copy; the cached arrays must not change
    X2, y2 = load_digits('train')
    X3, y3 = load_digits('train')
    assert np.array_equal(X2, X3) and np.array_equal(y1, y2)
    assert not np.all(X2 == 0)


def test_digits_normalisation_uses_train_statistics():
    raw_tr = load_digits('train', normalize=False)[0].astype(np.float64) / 16
    assert abs(raw_tr.mean() - DIGITS_MEAN) < 1e-9 and abs(raw_tr.std() - DIGITS_STD) < 1e-9
    Xtr = load_digits('train')[0]
    assert abs(Xtr.mean()) < 1e-5 and abs(Xtr.std() - 1) < 1e-5
    raw_te = load_digits('test', normalize=False)[0]
    assert raw_te.min() == 0 and raw_te.max() == 16
    np.testing.assert_allclose(load_digits('test')[0], (raw_te / 16 - DIGITS_MEAN) / DIGITS_STD, rtol=1e-6, atol=1e-6)


def test_digits_bad_split():
    with pytest.raises(TinycompError, match="unknown digits split"):
        load_digits('validation')


# ---------------------------------------------------------------- MNIST digits, shipped
def test_mnist5k_shapes_splits_and_stratification():
    sizes = {}
    for split in ('train', 'val', 'test', 'all'):
        X, y = load_mnist5k(split)
        assert X.dtype == np.float32 and y.dtype == np.int64 and X.shape == (len(y), 1, 28, 28)
        assert np.bincount(y, minlength=10).tolist() == [len(y) // 10] * 10     # 500 of each digit, split evenly
        sizes[split] = len(y)
    assert sizes == {'train': 3500, 'val': 500, 'test': 1000, 'all': 5000} and split_sizes('mnist5k') == {
        'train': 3500, 'val': 500, 'test': 1000}
    raw = [load_mnist5k(s, normalize=False)[0].reshape(-1, 784) for s in ('train', 'val', 'test')]
    assert np.array_equal(np.sort(np.concatenate(raw), axis=0), np.sort(load_mnist5k('all', normalize=False)[0].reshape(-1, 784), axis=0))
    assert raw[0].min() == 0 and raw[0].max() == 255
    with pytest.raises(TinycompError, match="unknown MNIST split"): load_mnist5k('validation')


def test_mnist5k_normalisation_uses_train_statistics():
    raw_tr = load_mnist5k('train', normalize=False)[0].astype(np.float64) / 255
    assert abs(raw_tr.mean() - MNIST5K_MEAN) < 1e-9 and abs(raw_tr.std() - MNIST5K_STD) < 1e-9
    raw_te = load_mnist5k('test', normalize=False)[0]
    np.testing.assert_allclose(load_mnist5k('test')[0], (raw_te / 255 - MNIST5K_MEAN) / MNIST5K_STD, rtol=1e-6, atol=1e-6)


def test_shipped_data_by_name():
    assert sample_shape('digits') == (1, 8, 8) and sample_shape('mnist5k') == (1, 28, 28)
    for name in ('digits', 'mnist5k'):
        splits = load_splits(name)
        assert sorted(splits) == ['test', 'train', 'val']
        assert np.array_equal(splits['test'][0], load_shipped(name, 'test')[0])
    with pytest.raises(TinycompError, match="unknown shipped data set 'cifar10'.*digits, mnist5k"): load_shipped('cifar10')


def _write_mnist5k(path, images, labels, split):
    np.savez_compressed(path, images=images, labels=labels, split=split)


@pytest.mark.parametrize('damage,message', [
    (lambda a: a[0].__setitem__((7, 14, 14), a[0][7, 14, 14] ^ 1), 'checksum differs'),   # one pixel changed
    (lambda a: a[1].__setitem__(3, (a[1][3] + 1) % 10), 'checksum differs'),              # one label changed
    (lambda a: a.__setitem__(0, a[0][:, :27]), 'unexpected shapes'),
    (lambda a: a.__setitem__(0, a[0].astype(np.int16)), 'checksum differs'),
])
def test_a_damaged_mnist5k_file_is_refused(tmp_path, monkeypatch, damage, message):
    arrays = [np.array(a) for a in data._mnist5k_arrays()]
    damage(arrays)
    bad = tmp_path / 'mnist5k.npz'
    _write_mnist5k(bad, *arrays)
    monkeypatch.setattr(data, 'MNIST5K_FILE', bad)
    data._mnist5k_arrays.cache_clear()
    try:
        with pytest.raises(DataError, match=message): load_mnist5k('test')
    finally:
        monkeypatch.undo()
        data._mnist5k_arrays.cache_clear()
    assert len(load_mnist5k('test')[1]) == 1000                                     # the shipped file again


def test_an_unreadable_mnist5k_file_says_reinstall(tmp_path, monkeypatch):
    bad = tmp_path / 'mnist5k.npz'
    bad.write_bytes(b'PK\x03\x04 not a zip')
    monkeypatch.setattr(data, 'MNIST5K_FILE', bad)
    data._mnist5k_arrays.cache_clear()
    try:
        with pytest.raises(DataError, match='cannot read the shipped MNIST file.*Reinstall'): load_mnist5k()
    finally:
        monkeypatch.undo()
        data._mnist5k_arrays.cache_clear()


def test_the_script_that_rebuilds_mnist5k_parses_the_csv(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / 'data'))
    import make_mnist5k
    rows = [[0] * 783 + [255, 7], [12] * 784 + [3]]
    raw = gzip.compress('\n'.join(','.join(map(str, r)) for r in rows).encode())
    images, labels = make_mnist5k.mnist5k_from_csv(raw)
    assert images.shape == (2, 28, 28) and images.dtype == np.uint8 and images[0, 27, 27] == 255
    assert labels.tolist() == [7, 3] and labels.dtype == np.uint8
    assert data.mnist5k_digest(images, labels) == data.mnist5k_digest(images.copy(), labels.astype(np.int64))
    with pytest.raises(ValueError, match='785 columns'): make_mnist5k.mnist5k_from_csv(gzip.compress(b'1,2,3'))
    with pytest.raises(ValueError, match='0..255'): make_mnist5k.mnist5k_from_csv(gzip.compress(','.join(['300'] * 785).encode()))
    assert make_mnist5k.OUT == Path(data.MNIST5K_FILE)                             # it writes the file tinycomp reads


# ---------------------------------------------------------------- DataLoader
def test_two_spirals_shapes_dtypes_seed_and_geometry():
    X, y = two_spirals(n_per_class=30, seed=4)
    assert X.shape == (60, 2) and X.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(y), [30, 30])
    np.testing.assert_array_equal(y[:30], 0)
    np.testing.assert_array_equal(two_spirals(n_per_class=30, seed=4)[0], X)
    assert not np.array_equal(two_spirals(n_per_class=30, seed=5)[0], X)
    clean, _ = two_spirals(n_per_class=30, noise=0, seed=4)
    np.testing.assert_allclose(clean[30:], -clean[:30])          # the second arm is the first turned by 180 degrees
    assert np.linalg.norm(clean, axis=1).max() <= 1 + 1e-6
    assert two_spirals()[0].shape == (400, 2)                       # the default used by module 01's example


def test_dataloader_batches_in_order():
    X, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10)
    dl = DataLoader(X, y, batch_size=4)
    batches = list(dl)
    assert len(dl) == 3 == len(batches)
    assert [len(yb) for _, yb in batches] == [4, 4, 2]
    assert np.array_equal(np.concatenate([xb for xb, _ in batches]), X)
    assert np.array_equal(np.concatenate([yb for _, yb in batches]), y)
    assert list(DataLoader(X, y, batch_size=10))[0][0].shape == (10, 2)
    assert len(DataLoader(X, y, batch_size=64)) == 1


def test_dataloader_accepts_tensors_and_strided_arrays():
    from tinycomp.tensor import Tensor
    X = np.arange(40, dtype=np.float32).reshape(10, 4)[:, ::2]
    xb, yb = next(iter(DataLoader(Tensor(X), np.arange(10), batch_size=3)))
    assert isinstance(xb, np.ndarray) and np.array_equal(xb, X[:3]) and np.array_equal(yb, [0, 1, 2])


def test_dataloader_drop_last():
    X, y = np.zeros((10, 3)), np.arange(10)
    dl = DataLoader(X, y, batch_size=4, drop_last=True)
    assert len(dl) == 2 and [len(yb) for _, yb in dl] == [4, 4]
    assert len(DataLoader(X, y, batch_size=11, drop_last=True)) == 0
    assert len(DataLoader(X, y, batch_size=5, drop_last=True)) == 2


def test_dataloader_seeded_shuffle():
    X, y = np.arange(50, dtype=np.float32)[:, None], np.arange(50)
    epochs = lambda dl, k: [np.concatenate([yb for _, yb in dl]) for _ in range(k)]
    a = epochs(DataLoader(X, y, 8, shuffle=True, seed=123), 3)
    b = epochs(DataLoader(X, y, 8, shuffle=True, seed=123), 3)
    c = epochs(DataLoader(X, y, 8, shuffle=True, seed=124), 1)
    for ea, eb in zip(a, b):
        assert np.array_equal(ea, eb)                    # deterministic given the seed
        assert np.array_equal(np.sort(ea), y)            # every sample exactly once
    assert not np.array_equal(a[0], a[1])                # a new permutation each epoch
    assert not np.array_equal(a[0], y)                   # actually shuffled
    assert not np.array_equal(a[0], c[0])                # the seed matters
    for xb, yb in DataLoader(X, y, 8, shuffle=True, seed=1):
        assert np.array_equal(xb[:, 0], yb)              # x and y stay paired


def test_dataloader_errors():
    X, y = np.zeros((10, 2)), np.arange(10)
    with pytest.raises(ShapeError, match="same length"):
        DataLoader(X, y[:9])
    for bad in (0, -1, 2.5, True, '8'):
        with pytest.raises(TinycompError, match="positive integer"):
            DataLoader(X, y, batch_size=bad)
    with pytest.raises(ShapeError):
        DataLoader(np.float32(1), y)


# ---------------------------------------------------------------- downloads: MNIST / Fashion-MNIST
def test_data_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv('TINYCOMP_DATA', str(tmp_path / 'x'))
    assert data.data_dir() == tmp_path / 'x'
    monkeypatch.delenv('TINYCOMP_DATA')
    assert data.data_dir() == Path.home() / '.cache' / 'tinycomp'


def test_mnist_download_cache_and_offline_reuse(server, cache, monkeypatch):
    arrays, blobs = serve_mnist(server, monkeypatch)
    with pytest.raises(DataError, match="download=True"):
        load_mnist('train')                               # nothing cached, no download requested
    assert server.requests == []
    X, y = load_mnist('train', download=True, normalize=False)
    assert X.shape == (7, 1, 28, 28) and X.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(X[:, 0], arrays['train-images-idx3-ubyte.gz'])
    assert np.array_equal(y, arrays['train-labels-idx1-ubyte.gz'])
    assert len(server.requests) == 4                      # all four files fetched once
    assert leftovers(cache) == sorted(f'mnist/{k}' for k in blobs)
    for k, b in blobs.items():
        assert (cache / 'mnist' / k).read_bytes() == b
    server.stop()                                         # offline from here on
    Xt, yt = load_mnist('test')
    assert Xt.shape == (3, 1, 28, 28)
    assert np.array_equal(yt, arrays['t10k-labels-idx1-ubyte.gz'])
    mean, std = data.NORM_STATS['mnist']
    np.testing.assert_allclose(load_mnist('train')[0], (X / 255 - mean[0]) / std[0], rtol=1e-5, atol=1e-5)
    load_mnist('train', download=True)                    # cached: no network needed even when allowed
    assert len(server.requests) == 4


def test_fashion_mnist_from_explicit_root_and_mirror(server, tmp_path, monkeypatch):
    arrays, blobs = serve_mnist(server, monkeypatch, name='fashion_mnist')
    monkeypatch.setitem(DATASETS['fashion_mnist'], 'base_url', 'http://127.0.0.1:9/unused/')
    root = tmp_path / 'mine'
    X, y = load_fashion_mnist('test', root=root, download=True, base_url=server.url.rstrip('/'))
    assert X.shape == (3, 1, 28, 28) and np.array_equal(y, arrays['t10k-labels-idx1-ubyte.gz'])
    assert (root / 'fashion_mnist' / 't10k-images-idx3-ubyte.gz').is_file()
    flat = tmp_path / 'flat'                              # files directly in root are found too
    flat.mkdir()
    for k, b in blobs.items():
        (flat / k).write_bytes(b)
    assert load_fashion_mnist('train', root=flat)[0].shape == (7, 1, 28, 28)
    with pytest.raises(TinycompError, match="unknown split"):
        load_fashion_mnist('val', root=flat)


def test_checksum_mismatch_leaves_nothing(server, cache, monkeypatch):
    serve_mnist(server, monkeypatch, **{'train-images-idx3-ubyte.gz': (10 ** 6, '0' * 64)})
    with pytest.raises(DataError, match="checksum mismatch"):
        load_mnist('train', download=True)
    assert not any('train-images' in p for p in leftovers(cache))
    assert not any(p.endswith('.part') for p in leftovers(cache))


def test_truncated_gzip_with_matching_checksum_is_rejected(server, cache, monkeypatch):
    _, blobs = mnist_like()
    bad = blobs['train-images-idx3-ubyte.gz'][:-20]
    serve_mnist(server, monkeypatch, files={'train-images-idx3-ubyte.gz': bad})
    with pytest.raises(DataError, match="gzip"):
        load_mnist('train', download=True)
    assert not any('train-images' in p or p.endswith('.part') for p in leftovers(cache))


def test_truncated_download_fails_checksum(server, cache, monkeypatch):
    _, blobs = mnist_like()
    good = blobs['train-images-idx3-ubyte.gz']
    serve_mnist(server, monkeypatch, files={'train-images-idx3-ubyte.gz': good[:len(good) // 2]},
                **{'train-images-idx3-ubyte.gz': (len(good), sha(good))})
    with pytest.raises(DataError, match="checksum mismatch"):
        load_mnist('train', download=True)
    assert not any('train-images' in p or p.endswith('.part') for p in leftovers(cache))


def test_wrong_magic_and_wrong_length(server, cache, monkeypatch):
    imgs = np.zeros((7, 28, 28))
    serve_mnist(server, monkeypatch, files={'train-images-idx3-ubyte.gz': idx_gz(imgs, magic=[0, 0, 9, 3])})
    with pytest.raises(DataError, match="magic") as err:
        load_mnist('train', download=True)
    assert server.url in str(err.value) and '.part' not in str(err.value)
    assert not any('train-images' in p or p.endswith('.part') for p in leftovers(cache))
    # header promises 7 images but the payload holds 6
    short = gzip.compress(gzip.decompress(idx_gz(imgs))[:-784])
    server.put('train-images-idx3-ubyte.gz', short)
    monkeypatch.setitem(DATASETS['mnist']['files'], 'train-images-idx3-ubyte.gz', (len(short), sha(short)))
    with pytest.raises(DataError, match="truncated"):
        load_mnist('train', download=True)
    assert not any('train-images' in p or p.endswith('.part') for p in leftovers(cache))
    # labels file given where images are expected (1-D, not 3-D)
    labels = idx_gz(np.zeros(7))
    server.put('train-images-idx3-ubyte.gz', labels)
    monkeypatch.setitem(DATASETS['mnist']['files'], 'train-images-idx3-ubyte.gz', (len(labels), sha(labels)))
    with pytest.raises(DataError, match="1-D array, expected 3-D"):
        load_mnist('train', download=True)


def test_mismatched_image_and_label_counts(server, cache, monkeypatch):
    serve_mnist(server, monkeypatch, files={'train-labels-idx1-ubyte.gz': idx_gz(np.zeros(6))})
    with pytest.raises(DataError, match="7 images but 6 labels"):
        load_mnist('train', download=True)


def test_http_errors_and_oversized_responses(server, cache, monkeypatch):
    serve_mnist(server, monkeypatch)
    (server.directory / 'train-labels-idx1-ubyte.gz').unlink()         # 404
    with pytest.raises(DataError, match="could not download"):
        load_mnist('train', download=True)
    assert not any('train-labels' in p or p.endswith('.part') for p in leftovers(cache))
    _, blobs = mnist_like()
    server.put('train-labels-idx1-ubyte.gz', blobs['train-labels-idx1-ubyte.gz'] + b'\0' * 100)
    with pytest.raises(DataError, match="more than the expected"):
        load_mnist('train', download=True)
    assert not any('train-labels' in p or p.endswith('.part') for p in leftovers(cache))
    with pytest.raises(DataError, match="only http, https and file"):
        data.download_file('ftp://127.0.0.1/x', cache / 'x', '0' * 64)


def test_corrupt_cached_file_is_reported_then_replaced(server, cache, monkeypatch):
    arrays, blobs = serve_mnist(server, monkeypatch)
    load_mnist('train', download=True)
    (cache / 'mnist' / 'train-labels-idx1-ubyte.gz').write_bytes(b'garbage')
    with pytest.raises(DataError, match="SHA-256"):
        load_mnist('train')
    X, y = load_mnist('train', download=True)               # a fresh, verified copy replaces it
    assert np.array_equal(y, arrays['train-labels-idx1-ubyte.gz'])
    assert (cache / 'mnist' / 'train-labels-idx1-ubyte.gz').read_bytes() == blobs['train-labels-idx1-ubyte.gz']
    (cache / 'mnist' / 'train-labels-idx1-ubyte.gz').write_bytes(b'garbage')
    with pytest.raises(DataError, match="gzip"):             # verify=False still checks the format
        load_mnist('train', verify=False)


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown data set"):
        data.fetch('imagenet')


def test_published_checksum_table_is_well_formed():
    for name, spec in DATASETS.items():
        assert spec['base_url'].startswith(('http://', 'https://'))
        for fname, (size, digest) in spec['files'].items():
            assert size > 1000 and len(digest) == 64 and int(digest, 16) >= 0
    assert set(DATASETS['mnist']['files']) == {f for pair in data._IDX_FILES.values() for f in pair}


# ---------------------------------------------------------------- CIFAR-10 (binary version)
def serve_cifar(server, monkeypatch, blob, **override):
    server.put('cifar-10-binary.tar.gz', blob)
    monkeypatch.setitem(DATASETS, 'cifar10', {'base_url': server.url,
                                              'files': table({'cifar-10-binary.tar.gz': blob}, **override)})


def test_cifar10_download_parse_and_offline(server, cache, monkeypatch):
    blob, recs = cifar_tar(per_batch=2)
    serve_cifar(server, monkeypatch, blob)
    X, y = load_cifar10('train', download=True, normalize=False)
    train = np.concatenate([recs[m] for m in data.CIFAR10_MEMBERS['train']])
    assert X.shape == (10, 3, 32, 32) and y.dtype == np.int64
    assert np.array_equal(y, train[:, 0])
    assert np.array_equal(X[3, 0].ravel(), train[3, 1:1025])        # red plane
    assert np.array_equal(X[3, 2].ravel(), train[3, 2049:])         # blue plane
    assert leftovers(cache) == ['cifar10/cifar-10-binary.tar.gz']
    server.stop()
    Xt, yt = load_cifar10('test')
    test = recs[data.CIFAR10_MEMBERS['test'][0]]
    mean, std = (np.array(s, dtype=np.float32).reshape(1, 3, 1, 1) for s in data.NORM_STATS['cifar10'])
    np.testing.assert_allclose(Xt, (test[:, 1:].reshape(-1, 3, 32, 32) / 255 - mean) / std, rtol=1e-5, atol=1e-5)
    assert np.array_equal(yt, test[:, 0])


def test_cifar10_truncated_archive(server, cache, monkeypatch):
    blob, _ = cifar_tar(per_batch=2)
    serve_cifar(server, monkeypatch, blob[:len(blob) // 2])
    with pytest.raises(DataError, match="truncated"):
        load_cifar10('train', download=True)
    assert leftovers(cache) == []


def test_cifar10_bad_records_and_missing_members(server, cache, monkeypatch, tmp_path):
    blob, _ = cifar_tar(per_batch=2, mutate=lambda m, b: b[:-1] if m.endswith('_3.bin') else b)
    serve_cifar(server, monkeypatch, blob)
    with pytest.raises(DataError, match="multiple of 3073"):
        load_cifar10('train', download=True)
    assert leftovers(cache) == []
    python_version, _ = cifar_tar(members=['cifar-10-batches-py/data_batch_1'])
    serve_cifar(server, monkeypatch, python_version)
    with pytest.raises(DataError, match="lacks"):
        load_cifar10('test', download=True)
    assert leftovers(cache) == []
    bad_label, _ = cifar_tar(per_batch=1, mutate=lambda m, b: bytes([200]) + b[1:])
    p = tmp_path / 'bad.tar.gz'
    p.write_bytes(bad_label)
    with pytest.raises(DataError, match="not a class"):
        data.read_cifar10_binary(p, 'test')
    p.write_bytes(b'not a tar at all')
    with pytest.raises(DataError, match="not a valid CIFAR-10"):
        data.read_cifar10_binary(p, 'train')


def test_read_idx_direct(tmp_path):
    p = tmp_path / 'a.gz'
    p.write_bytes(idx_gz(np.arange(6).reshape(2, 3)))
    assert np.array_equal(read_idx(p), np.arange(6).reshape(2, 3))
    p.write_bytes(idx_gz(np.arange(6), magic=[0, 0, 0x0D, 1]))     # float IDX: not accepted
    with pytest.raises(DataError, match="magic"):
        read_idx(p)
    p.write_bytes(gzip.compress(b'\0\0\x08\x03\0\0'))               # header cut short
    with pytest.raises(DataError, match="truncated"):
        read_idx(p)
