import pytest

@pytest.mark.parametrize("i", range(5))
def test_probe(client, auth, i):
    assert client.get("/v1/files", headers=auth).status_code == 200
