//! Length-prefixed frames: `u32` big-endian body length, then the body.
//!
//! The length is checked against a hard cap *before* anything is allocated, so a
//! hostile 4 GiB prefix costs us four bytes of reading and a closed socket.

use crate::error::{CoreError, CoreResult};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Reads one frame body into `buf` (cleared first). Returns `Ok(false)` on a clean EOF
/// before the first byte of a frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max_len: usize,
) -> CoreResult<bool> {
    let mut len_bytes = [0u8; 4];
    let got = reader
        .read(&mut len_bytes)
        .await
        .map_err(|e| CoreError::io("reading frame header", e))?;
    if got == 0 {
        return Ok(false);
    }
    // EOF inside the length prefix is a truncated frame, not a clean end.
    reader
        .read_exact(&mut len_bytes[got..])
        .await
        .map_err(|e| CoreError::io("reading frame header", e))?;
    let len = u32::from_be_bytes(len_bytes) as usize;
    if len > max_len {
        if len_bytes.iter().all(|b| (32..127).contains(b)) {
            // Text where a length belongs: another protocol (HTTP, SSH, a port scanner).
            return Err(CoreError::Protocol(format!(
                "the other side is not speaking pccl (it sent {:?} where a frame length \
                 belongs): check the address and port",
                String::from_utf8_lossy(&len_bytes)
            )));
        }
        return Err(CoreError::Protocol(format!(
            "frame of {len} bytes exceeds the limit of {max_len} bytes"
        )));
    }
    buf.clear();
    buf.resize(len, 0);
    reader
        .read_exact(buf)
        .await
        .map_err(|e| CoreError::io("reading frame body", e))?;
    Ok(true)
}

pub async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, body: &[u8]) -> CoreResult<()> {
    let len = u32::try_from(body.len())
        .map_err(|_| CoreError::InvalidArgument("frame body larger than 4 GiB".into()))?;
    writer
        .write_all(&len.to_be_bytes())
        .await
        .map_err(|e| CoreError::io("writing frame header", e))?;
    writer
        .write_all(body)
        .await
        .map_err(|e| CoreError::io("writing frame body", e))?;
    writer
        .flush()
        .await
        .map_err(|e| CoreError::io("flushing frame", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn eof_inside_the_length_prefix_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[0, 0]).await.unwrap();
        drop(a);
        let mut buf = Vec::new();
        assert!(read_frame(&mut b, &mut buf, 16).await.is_err());
        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(!read_frame(&mut b, &mut buf, 16).await.unwrap());
    }

    #[tokio::test]
    async fn round_trip() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, b"hello").await.unwrap();
        write_frame(&mut a, b"").await.unwrap();
        drop(a);
        let mut buf = Vec::new();
        assert!(read_frame(&mut b, &mut buf, 16).await.unwrap());
        assert_eq!(buf, b"hello");
        assert!(read_frame(&mut b, &mut buf, 16).await.unwrap());
        assert!(buf.is_empty());
        assert!(!read_frame(&mut b, &mut buf, 16).await.unwrap());
    }

    #[tokio::test]
    async fn oversized_prefix_is_rejected_without_allocating() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        let mut buf = Vec::new();
        let err = read_frame(&mut b, &mut buf, 1024).await.unwrap_err();
        assert!(matches!(err, CoreError::Protocol(_)));
        assert_eq!(buf.capacity(), 0);
    }

    #[tokio::test]
    async fn text_where_a_length_belongs_is_named_as_another_protocol() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let mut buf = Vec::new();
        match read_frame(&mut b, &mut buf, 1024).await.unwrap_err() {
            CoreError::Protocol(m) => {
                assert!(m.contains("not speaking pccl (it sent \"GET \""), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn truncated_body_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&10u32.to_be_bytes()).await.unwrap();
        a.write_all(b"abc").await.unwrap();
        drop(a);
        let mut buf = Vec::new();
        assert!(read_frame(&mut b, &mut buf, 1024).await.is_err());
    }
}
