//! Clients that are slow on purpose, as real ones are: a client that uploads its request body
//! slowly, one that reads its response slowly, and an HTTP/2 client that grants no
//! flow-control window at all. They exercise what the filter must not confuse with the
//! upstream's behaviour ("slow" is the upstream's latency; a refusal holds no unit).
//!
//! Everything connects to 127.0.0.1 and every wait is bounded.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use crate::Error;

/// How long any one slow exchange may take in all.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// A `POST` whose `body_len`-byte body is sent one byte every `byte_every` (after the headers),
/// with `headers`; returns the response's status and how long the whole exchange took.
pub async fn slow_upload(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body_len: usize,
    byte_every: Duration,
) -> Result<(u16, Duration), Error> {
    let started = Instant::now();
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut head = format!("POST {path} HTTP/1.1\r\nhost: floodgate.test\r\ncontent-length: {body_len}\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("connection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await?;
        for _ in 0..body_len {
            tokio::time::sleep(byte_every).await;
            stream.write_all(b"x").await?;
        }
        let status = read_status_and_drain(&mut stream, None).await?;
        Ok::<_, Error>(status)
    };
    let status = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await??;
    Ok((status, started.elapsed()))
}

/// A `GET` whose response is read `chunk` bytes every `chunk_every`, through a receive buffer of
/// `chunk` bytes (so the kernel does not read ahead for it); returns the status, the body bytes
/// read, and how long the whole exchange took.
pub async fn slow_download(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    chunk: usize,
    chunk_every: Duration,
) -> Result<(u16, usize, Duration), Error> {
    let started = Instant::now();
    let exchange = async {
        let socket = TcpSocket::new_v4()?;
        socket.set_recv_buffer_size(u32::try_from(chunk).unwrap_or(u32::MAX))?;
        let mut stream = socket.connect(addr).await?;
        let mut head = format!("GET {path} HTTP/1.1\r\nhost: floodgate.test\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("connection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await?;
        let mut read = 0usize;
        let status = read_status_and_drain(&mut stream, Some((chunk, chunk_every, &mut read))).await?;
        Ok::<_, Error>((status, read))
    };
    let (status, read) = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await??;
    Ok((status, read, started.elapsed()))
}

/// Reads a response until the connection closes (the requests ask for `connection: close`);
/// with `pace`, at most `chunk` bytes per read and a pause of `every` after each, counting the
/// bytes read. Returns the status code.
async fn read_status_and_drain(
    stream: &mut TcpStream,
    mut pace: Option<(usize, Duration, &mut usize)>,
) -> Result<u16, Error> {
    let mut head = Vec::new();
    let mut buf = vec![0u8; pace.as_ref().map_or(16 * 1024, |p| p.0.max(1))];
    let mut status = None;
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        if status.is_none() {
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                let line = String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_owned();
                status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok());
            }
        }
        if let Some((_, every, read)) = pace.as_mut() {
            **read += n;
            tokio::time::sleep(*every).await;
        }
    }
    status.ok_or_else(|| format!("no status line in {:?}", String::from_utf8_lossy(&head)).into())
}

/// An HTTP/2 connection (prior knowledge, cleartext) whose client advertises an initial stream
/// window of 0 bytes (`SETTINGS_INITIAL_WINDOW_SIZE`) and never grants more: the server can
/// send a response's headers but not a byte of its body, so every stream stays open until the
/// connection goes. Dropping it closes the connection.
pub struct StalledH2 {
    send: h2::client::SendRequest<Bytes>,
    /// The response bodies, held unread.
    held: Mutex<Vec<h2::RecvStream>>,
    connection: JoinHandle<()>,
}

impl StalledH2 {
    /// Connects to `addr` and completes the HTTP/2 handshake.
    pub async fn connect(addr: SocketAddr) -> StalledH2 {
        let tcp = TcpStream::connect(addr).await.expect("connect for HTTP/2");
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .expect("HTTP/2 handshake");
        StalledH2 {
            send,
            held: Mutex::new(Vec::new()),
            connection: tokio::spawn(async move {
                let _ = connection.await;
            }),
        }
    }

    /// Sends a `GET` of `path` with `headers` and returns the response's status, keeping its
    /// stream open and its body unread.
    pub async fn request(&self, path: &str, headers: &[(&str, &str)]) -> u16 {
        let mut request = http::Request::get(format!("http://floodgate.test{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(()).expect("an HTTP/2 request");
        let mut send = self.send.clone().ready().await.expect("HTTP/2 stream capacity");
        let (response, _) = send.send_request(request, true).expect("send on HTTP/2");
        let response = tokio::time::timeout(EXCHANGE_TIMEOUT, response)
            .await
            .expect("HTTP/2 response headers in time")
            .expect("HTTP/2 response");
        let status = response.status().as_u16();
        self.held.lock().expect("held streams").push(response.into_body());
        status
    }
}

impl Drop for StalledH2 {
    fn drop(&mut self) {
        self.connection.abort();
    }
}
