#!/usr/bin/env python3
"""Prints the Shared Key signatures that Microsoft's own Python SDK (azure-storage-blob's
SharedKeyCredentialPolicy) computes for the requests tests/storage/test_azure_storage.cpp
signs, so that our signer is checked against an implementation that is not ours.

Usage: python3 tests/tools/azure_shared_key_reference.py   (needs `pip install azure-storage-blob`)

The key is the storage emulator's well-known development key (public, in Microsoft's docs).
"""
from azure.core.pipeline import PipelineContext, PipelineRequest
from azure.core.rest import HttpRequest
from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DATE = "Mon, 07 Dec 2026 12:00:00 GMT"

CASES = [
    # (name, account, method, url, extra headers)
    ("properties", "myaccount", "HEAD",
     "https://myaccount.blob.core.windows.net/mycontainer/models/a%20b%2Bc.safetensors", {}),
    ("list", "myaccount", "GET",
     "https://myaccount.blob.core.windows.net/mycontainer?restype=container&comp=list&maxresults=5000"
     "&prefix=models%2Fllama%2F&delimiter=%2F&marker=2%21abc", {}),
    ("range_emulator", "devstoreaccount1", "GET",
     "http://127.0.0.1:10000/devstoreaccount1/mycontainer/model.safetensors",
     {"x-ms-range": "bytes=4096-1052671"}),
    ("create_container", "devstoreaccount1", "PUT",
     "http://127.0.0.1:10000/devstoreaccount1/mycontainer?restype=container", {"Content-Length": "0"}),
    ("put_blob", "myaccount", "PUT", "https://myaccount.blob.core.windows.net/mycontainer/dir/w.bin",
     {"Content-Length": "11", "Content-Type": "application/octet-stream", "x-ms-blob-type": "BlockBlob"}),
]


def main():
    for name, account, method, url, extra in CASES:
        request = HttpRequest(method, url)
        request.headers["x-ms-date"] = DATE
        request.headers["x-ms-version"] = "2021-08-06"
        for header, value in extra.items():
            request.headers[header] = value
        pipeline_request = PipelineRequest(request, PipelineContext(None))
        SharedKeyCredentialPolicy(account, KEY).on_request(pipeline_request)
        print(f"{name}: {request.headers['Authorization']}")


if __name__ == "__main__":
    main()
