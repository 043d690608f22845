#!/usr/bin/env python3
"""Writes the seed corpora of the storage-layer fuzz targets (fuzz_uri, fuzz_s3_listing,
fuzz_azure_listing)
into fuzz/corpus/<target>/. The seeds are small, valid or nearly valid inputs that reach
each branch of the parsers, so the fuzzer starts from structure rather than noise.
Deterministic: running it again rewrites the same files. Usage: fuzz/make_corpus.py
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

URIS = {
    "plain_path": "models/llama-3-8b",
    "absolute_path": "/models/llama/model-00001-of-00004.safetensors",
    "file_uri": "file:///models/llama",
    "file_localhost": "file://localhost/models/llama",
    "file_relative": "file://models",
    "s3_prefix": "s3://my-bucket/models/llama/",
    "s3_object": "s3://my.bucket-1/models/llama/model.safetensors",
    "s3_bucket_only": "s3://bucket",
    "s3_upper_scheme": "S3://bucket/KEY",
    "s3_bad_bucket": "s3://Bad_Bucket/x",
    "https": "https://example.com/model.safetensors",
    "unknown_scheme": "gs://bucket/prefix",
    "empty_rest": "s3://",
    "az_prefix": "az://myaccount/models/llama/",
    "az_root_container": "az://myaccount/$root/model.safetensors",
    "az_bad_container": "az://myaccount/a--b/x",
    "az_blob_url": "https://myaccount.blob.core.windows.net/models/llama",
    "az_blob_url_with_query": "https://myaccount.blob.core.windows.net/models/m?sv=1&sig=x",
}

LIST_PAGE = """<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bucket</Name><Prefix>models/llama/</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys>
  <IsTruncated>{truncated}</IsTruncated>{token}
  <Contents><Key>models/llama/config.json</Key><Size>{size}</Size><ETag>"0a1b"</ETag></Contents>
  <Contents><Key>models/llama/model-00001-of-00002.safetensors</Key><Size>4976698672</Size></Contents>
  <CommonPrefixes><Prefix>models/llama/sub/</Prefix></CommonPrefixes>
</ListBucketResult>
"""

LISTINGS = {
    "page": LIST_PAGE.format(truncated="false", token="", size="688"),
    "truncated_page": LIST_PAGE.format(truncated="true", token="<NextContinuationToken>1ueGcxLPRx1</NextContinuationToken>",
                                       size="688"),
    "truncated_without_token": LIST_PAGE.format(truncated="true", token="", size="688"),
    "size_not_a_number": LIST_PAGE.format(truncated="false", token="", size="-1"),
    "size_too_large": LIST_PAGE.format(truncated="false", token="", size="18446744073709551616"),
    "empty_listing": '<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>',
    "wrong_root": "<ListAllMyBucketsResult><Buckets/></ListAllMyBucketsResult>",
    "error_body": """<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>
<RequestId>4442587FB7D0A2F9</RequestId><Region>eu-west-1</Region></Error>
""",
    "error_control_characters": "<Error><Code>A\x01B</Code><Message>" + "m" * 300 + "</Message></Error>",
    "entities_and_cdata": "<Error><Code>&lt;&amp;&#x41;</Code><Message><![CDATA[<x>]]></Message></Error>",
    "doctype": '<!DOCTYPE Error [<!ENTITY e "expanded">]><Error><Code>&e;</Code></Error>',
}


AZURE_LIST_PAGE = """\ufeff<?xml version="1.0" encoding="utf-8"?>
<EnumerationResults ServiceEndpoint="https://myaccount.blob.core.windows.net/" ContainerName="models">
  <Prefix>llama/</Prefix><MaxResults>5000</MaxResults><Delimiter>/</Delimiter>
  <Blobs>
    <Blob><Name>llama/config.json</Name><Properties><Content-Length>{size}</Content-Length>
      <BlobType>BlockBlob</BlobType></Properties></Blob>
    <BlobPrefix><Name>llama/sub/</Name></BlobPrefix>
  </Blobs>
  <NextMarker>{marker}</NextMarker>
</EnumerationResults>
"""

AZURE_LISTINGS = {
    "page": AZURE_LIST_PAGE.format(size="688", marker=""),
    "page_with_marker": AZURE_LIST_PAGE.format(size="688", marker="2!96!MDAwMDE"),
    "size_not_a_number": AZURE_LIST_PAGE.format(size="-1", marker=""),
    "size_too_large": AZURE_LIST_PAGE.format(size="18446744073709551616", marker=""),
    "blob_without_name": "<EnumerationResults><Blobs><Blob><Properties><Content-Length>1</Content-Length>"
                         "</Properties></Blob></Blobs></EnumerationResults>",
    "wrong_root": "<ListBucketResult/>",
    "error_body": """\ufeff<?xml version="1.0" encoding="utf-8"?><Error><Code>AuthenticationFailed</Code>
<Message>Server failed to authenticate the request.
RequestId:4b1e3f2a-0001-0000-0000-000000000000
Time:2026-12-07T12:00:00.0000000Z</Message><AuthenticationErrorDetail>The MAC signature found in the HTTP request
'abc' is not the same as any computed signature.</AuthenticationErrorDetail></Error>
""",
    "error_control_characters": "<Error><Code>A\x01B</Code><Message>" + "m" * 300 + "</Message></Error>",
}


def write(target, seeds):
    directory = HERE / "corpus" / target
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in seeds.items():
        (directory / name).write_bytes(text.encode("utf-8"))


if __name__ == "__main__":
    write("fuzz_uri", URIS)
    write("fuzz_s3_listing", LISTINGS)
    write("fuzz_azure_listing", AZURE_LISTINGS)
