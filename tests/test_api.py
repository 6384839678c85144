import httpx


def test_probe(client, auth):
    r = client.post("/v1/fine_tuning/jobs", headers={**auth, "content-type": "application/json"}, content=b'{"model": x}')
    print("badjson", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/jobs", headers={"content-type": "application/json"}, content=b'{"model": x}')
    print("badjson noauth", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/jobs", json={"model": 1})
    print("body noauth", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/jobs", headers=auth, json=[1])
    print("list body", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/jobs", headers=auth, json={"model": "tiny-policy", "training_file": "x", "method": {"type": "reinforcement"}})
    print("method missing cfg", r.status_code, r.json())
    g = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}", "reference": "{{ item.answer }}", "operation": "eq"}
    r = client.post("/v1/fine_tuning/alpha/graders/run", headers=auth, json={"grader": g, "model_sample": "red", "item": {"answer": "red"}})
    print("run", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/alpha/graders/validate", headers=auth, json={"grader": g})
    print("validate", r.status_code, r.json())
    r = client.post("/v1/fine_tuning/alpha/graders/run", headers=auth, json={"grader": g, "model_sample": "red", "item": {}})
    print("run missing", r.status_code, r.json())
    req = httpx.Request("POST", "http://x/v1/files", files={"file": ("a.jsonl", b'{"prompt":"a"}\n' * 10000)}, data={"purpose": "fine-tune"})
    body = req.read()
    def gen():
        for i in range(0, len(body), 4096):
            yield body[i:i+4096]
    r = client.post("/v1/files", headers={**auth, "content-type": req.headers["content-type"]}, content=gen())
    print("chunked", r.status_code, r.json() if r.status_code != 200 else r.json()["bytes"])
    r = client.put("/v1/files", headers=auth)
    print("put", r.status_code, r.json())
    r = client.get("/v1/files?limit=abc", headers=auth)
    print("limit abc", r.status_code, r.json())
