"""The Shared Key signatures tests/storage/test_azure_storage.cpp expects are the ones Microsoft's
own Python SDK computes: runs tests/tools/azure_shared_key_reference.py (azure-storage-blob's
SharedKeyCredentialPolicy) and finds each of its signatures in the C++ test. Skips where
azure-storage-blob is not installed.
"""

import re
import subprocess
import sys

import pytest
from conftest import ROOT


def test_the_cpp_tests_expect_the_sdks_signatures():
    pytest.importorskip("azure.storage.blob", reason="azure-storage-blob is not installed")
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "tools" / "azure_shared_key_reference.py")],
                            capture_output=True, text=True, timeout=120, check=True)
    signatures = re.findall(r"^(\w+): (SharedKey \S+)$", result.stdout, re.MULTILINE)
    assert len(signatures) == 5, result.stdout
    cpp = (ROOT / "tests" / "storage" / "test_azure_storage.cpp").read_text()
    for name, signature in signatures:
        assert '"%s"' % signature in cpp, "%s: the SDK signs %s" % (name, signature)
