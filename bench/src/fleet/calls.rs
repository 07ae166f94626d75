//! The simulated proxies' calls to `floodgate-sync`: a JSON `POST` over HTTP/2, one connection
//! per proxy to its replica (made again after a failure, as Envoy's connection pool does), each
//! call bounded by its timeout. The answer comes back as a [`Done`] on a channel, which the
//! fleet's loop hands to the worker that sent it.

use bytes::Bytes;
use floodgate::fleet::Answer;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// The header of a sync answer that gives the fleet size.
const PROXIES_HEADER: &str = "floodgate-proxies";

/// What a call is for (the store calls table counts each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A batched proxy's batch (`/v1/sync`).
    Batch,
    /// A batched key's ask (`/v1/lease`, exact).
    Ask,
    /// A leased key's lease call (`/v1/lease`).
    Lease,
}

/// A call to send.
pub struct Call {
    /// The proxy (its index in the fleet), and the generation of that proxy (a restarted
    /// proxy is a new one: answers to the old one's calls are dropped).
    pub proxy: usize,
    /// The proxy's generation.
    pub generation: u32,
    /// The worker in the proxy.
    pub worker: usize,
    /// The call's token.
    pub token: u32,
    /// What it is.
    pub kind: Kind,
    /// `:path`.
    pub path: &'static str,
    /// `:authority`.
    pub authority: String,
    /// The JSON body.
    pub body: Vec<u8>,
    /// Its timeout.
    pub timeout: Duration,
}

/// A call that ended.
pub struct Done {
    /// The proxy, generation, worker and token of the call.
    pub proxy: usize,
    /// The proxy's generation.
    pub generation: u32,
    /// The worker.
    pub worker: usize,
    /// The token.
    pub token: u32,
    /// Its answer.
    pub answer: Answer,
    /// The fleet-size header floodgate-sync answered with, if any, as read.
    pub proxies: Option<Vec<u8>>,
    /// Request and response body bytes.
    pub bytes: u64,
    /// How long it took, µs.
    pub took_us: u64,
}

/// One proxy's connection to its `floodgate-sync` replica, made at the first call and again
/// after one fails.
pub struct Conn {
    addr: SocketAddr,
    client: RefCell<Option<h2::client::SendRequest<Bytes>>>,
}

impl Conn {
    /// A connection to `addr`, not made yet.
    pub fn new(addr: SocketAddr) -> Rc<Conn> {
        Rc::new(Conn { addr, client: RefCell::new(None) })
    }

    async fn client(&self) -> Result<h2::client::SendRequest<Bytes>, String> {
        if let Some(client) = self.client.borrow().clone() {
            return Ok(client);
        }
        let stream = tokio::net::TcpStream::connect(self.addr).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let (client, conn) = h2::client::handshake(stream).await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        *self.client.borrow_mut() = Some(client.clone());
        Ok(client)
    }

    async fn post(&self, call: &Call) -> Result<(u16, Option<Vec<u8>>, Vec<u8>), String> {
        let client = self.client().await?;
        let mut client = client.ready().await.map_err(|e| e.to_string())?;
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}{}", call.authority, call.path))
            .header("content-type", "application/json")
            .body(())
            .map_err(|e| e.to_string())?;
        let (response, mut send) = client.send_request(request, false).map_err(|e| e.to_string())?;
        send.send_data(Bytes::from(call.body.clone()), true).map_err(|e| e.to_string())?;
        let response = response.await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let proxies = response.headers().get(PROXIES_HEADER).map(|v| v.as_bytes().to_vec());
        let mut body = response.into_body();
        let mut out = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            let _ = body.flow_control().release_capacity(chunk.len());
            out.extend_from_slice(&chunk);
        }
        Ok((status, proxies, out))
    }

    /// Sends `call` in a task of the current `LocalSet`; its [`Done`] goes to `done`.
    pub fn send(self: &Rc<Conn>, call: Call, done: UnboundedSender<Done>) {
        let conn = Rc::clone(self);
        tokio::task::spawn_local(async move {
            let started = std::time::Instant::now();
            let result = tokio::time::timeout(call.timeout, conn.post(&call)).await;
            let sent = call.body.len() as u64;
            let (answer, proxies, bytes) = match result {
                Ok(Ok((200, proxies, body))) => {
                    let n = body.len() as u64;
                    (Answer::Ok(body), proxies, sent + n)
                }
                Ok(Ok((status, proxies, body))) => (Answer::Failed(Some(u32::from(status))), proxies, sent + body.len() as u64),
                Ok(Err(_)) => {
                    // The connection failed: the next call makes a new one.
                    conn.client.borrow_mut().take();
                    (Answer::Failed(None), None, sent)
                }
                Err(_) => (Answer::Failed(None), None, sent),
            };
            let _ = done.send(Done {
                proxy: call.proxy,
                generation: call.generation,
                worker: call.worker,
                token: call.token,
                answer,
                proxies,
                bytes,
                took_us: started.elapsed().as_micros() as u64,
            });
        });
    }
}
