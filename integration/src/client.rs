//! HTTP/1.1 clients for the floodgate listener and the admin API: [`Client`] (hyper, one
//! keep-alive connection), [`get`] (one request on a new connection), [`raw_request`] (arbitrary
//! bytes over a TCP stream) and [`http_get_blocking`] (a blocking `GET`).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Timeout of one request made by the helpers in this crate.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Error type of the client helpers.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A response read by [`Client`].
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Response {
    /// A header's value as text (`None` if absent or not visible ASCII).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON; panics with the body if it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }
}

/// An HTTP/1.1 client on one keep-alive connection (hyper). Requests on one `Client` are sent one
/// after another; open several clients for concurrency.
pub struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Client {
    /// Opens a connection to `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<Client, Error> {
        let stream = tokio::time::timeout(REQUEST_TIMEOUT, TcpStream::connect(addr)).await??;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Client { sender })
    }

    /// Sends `GET path` with the given headers (plus `host: floodgate.test`) and reads the whole
    /// response.
    pub async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> Result<Response, Error> {
        self.send("GET", path, headers, Bytes::new()).await
    }

    /// Sends `method path` with `headers` and `body` (with its `content-length`; none for an
    /// empty `GET`) and reads the whole response.
    pub async fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: Bytes) -> Result<Response, Error> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "floodgate.test");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body))?;
        let fut = async {
            self.sender.ready().await?;
            let resp = self.sender.send_request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, Error>(Response {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut).await?
    }
}

/// One request on a new connection: `GET path` with `headers`. Panics on a transport error.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    let mut c = Client::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    c.get(path, headers)
        .await
        .unwrap_or_else(|e| panic!("GET {path} {headers:?}: {e}"))
}

/// A response read by [`raw_request`].
#[derive(Debug)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Status line and headers, as received (lossy UTF-8).
    pub head: String,
    /// The body (as much as was sent before the connection closed, or `content-length` bytes).
    pub body: Vec<u8>,
}

/// Sends `request` verbatim (it should ask for `connection: close`) on a new connection to `addr`
/// and reads one response. Use it for requests hyper would refuse to build, such as header values
/// that are not UTF-8.
pub async fn raw_request(addr: SocketAddr, request: &[u8]) -> Result<RawResponse, Error> {
    let fut = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.write_all(request).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(format!(
                    "connection closed before a full response head; got {:?}",
                    String::from_utf8_lossy(&buf)
                )
                .into());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line in {head:?}"))?;
        let content_length: Option<usize> = head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        });
        let mut body = buf[head_end..].to_vec();
        match content_length {
            Some(len) => {
                while body.len() < len {
                    let n = stream.read(&mut chunk).await?;
                    if n == 0 {
                        break;
                    }
                    body.extend_from_slice(&chunk[..n]);
                }
                body.truncate(len);
            }
            None => {
                stream.read_to_end(&mut body).await?;
            }
        }
        Ok::<_, Error>(RawResponse { status, head, body })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut).await?
}

/// Builds a `GET` request with a raw request target and raw header bytes, ending with
/// `host: floodgate.test` and `connection: close`.
pub fn raw_get_request(target: &[u8], headers: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(b"GET ");
    r.extend_from_slice(target);
    r.extend_from_slice(b" HTTP/1.1\r\nhost: floodgate.test\r\n");
    for (k, v) in headers {
        r.extend_from_slice(k);
        r.extend_from_slice(b": ");
        r.extend_from_slice(v);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"connection: close\r\n\r\n");
    r
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A blocking `GET` (HTTP/1.1, `connection: close`) used for Envoy's admin API; returns status and
/// body (de-chunked).
pub fn http_get_blocking(addr: SocketAddr, path: &str) -> Result<(u16, String), Error> {
    Ok(floodgate_harness::http_get(addr, path)?)
}
